"""Two Ray nodes: a local cluster of a head and a second raylet, and the tiny recipe with trainer.nnodes=2,
one rank per node, HiLoRe on. verl loads the plugin in every Ray worker on both nodes."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.harness import subprocess as harness

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# A driver script: start the two-node cluster, run main_ppo's entry against it, report where the ranks ran.
DRIVER = r"""
import json, sys, threading, time
import ray
from ray.cluster_utils import Cluster

# Each node declares one `cpu_rank`: the CPU platform then places one rank's bundle per node, as one
# GPU per node would (Ray alone may put both bundles on one node). CPUs are logical: a rank's bundle
# holds 3 (verl's max_colocate_count) and the transfer queue 2 more, on either node.
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "resources": {"cpu_rank": 1}})
cluster.add_node(num_cpus=8, resources={"cpu_rank": 1})
ray.init(address=cluster.address)
assert len([n for n in ray.nodes() if n["Alive"]]) == 2

rank_nodes = {}

def watch():  # each rank's rollout server runs on that rank's node (tensor_model_parallel_size=1)
    while len(rank_nodes) < 2:
        for replica in range(2):
            try:
                server = ray.get_actor(f"hilore_hf_rollout_{replica}")
                rank_nodes[replica] = ray.get(server.describe.remote())["node_id"]
            except Exception:
                pass
        time.sleep(1)

threading.Thread(target=watch, daemon=True).start()
from verl.trainer.main_ppo import main
sys.argv = ["main_ppo"] + sys.argv[1:]
try:
    main()
    print("RANK_NODES " + json.dumps(rank_nodes), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_tiny_recipe_on_two_nodes(tmp_path):
    from hilore_verl.tiny.task import make_tiny_task

    task = make_tiny_task(str(tmp_path / "task"))
    log = tmp_path / "steps.jsonl"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    args = ["--config-path", str(REPO / "recipes" / "grpo"), "--config-name", "tiny_cpu",
            "actor_rollout_ref.actor.hilore.enable=true", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
            "trainer.total_training_steps=2", "trainer.logger=[console,file]",
            f"actor_rollout_ref.model.path={task}/model", f"data.train_files={task}/train.parquet",
            f"data.val_files={task}/val.parquet"]
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log), "HYDRA_FULL_ERROR": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = harness.run([sys.executable, str(driver), *args], timeout_s=900, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:  # both ranks planned the same micro-batches within the budget, with no retry
        m = s["data"]
        assert m["actor/hilore/plan/predicted_peak_gib"] <= m["actor/hilore/plan/budget_gib"] * 1.0001, m
        assert m["actor/hilore/oom_retries"] == 0, m
    assert "profiled on" in out  # the first step probed and calibrated
    rank_nodes = json.loads(next(line for line in out.splitlines() if "RANK_NODES" in line).split("RANK_NODES ")[1])
    assert len(rank_nodes) == 2 and len(set(rank_nodes.values())) == 2, rank_nodes  # one rank on each node
