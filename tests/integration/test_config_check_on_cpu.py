"""verl's own trainer (`main_ppo`) stops on a bad `hilore:` section with one line, before Ray starts."""

import os
import sys
from pathlib import Path

import pytest

from hilore_verl.integration.actor.config_check import hilore_error, host_error
from tests.harness import subprocess as harness

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "grpo"


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.hilore.risk_budget=-1", "hilore.risk_budget: got -1; valid: a finite number >= 0"),
    ("+actor_rollout_ref.actor.hilore.budgett=1", "hilore.budgett: unknown key"),
    ("actor_rollout_ref.actor.strategy=fsdp", "hilore.enable=true needs actor_rollout_ref.actor.strategy=fsdp2"),
    ("trainer.device=cuda", "actor_rollout_ref.rollout.name=hf is the CPU rollout"),
    # Ray left to count this host's cores where the ranks, the transfer queue's storage units and one more
    # need more than any host here has (units: one more than the cores), so the check fires on every host
    (f"ray_kwargs.ray_init.num_cpus=null transfer_queue.enable=true "
     f"transfer_queue.backend.SimpleStorage.num_data_storage_units={(os.cpu_count() or 1) + 1}", "Ray would count"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
     "hilore.enable=true with actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 is not supported"),
    ("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",  # the key verl's engine reads
     "hilore.enable=true with actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2 is not supported"),
    ("actor_rollout_ref.model.use_liger=true", "hilore.enable=true with actor_rollout_ref.model.use_liger=true"),
    # the recipes' budget.value is null (gc_ratio's default): another mode does not read a ratio as GiB
    ("actor_rollout_ref.actor.hilore.budget.mode=auto", "hilore.budget.value: required with mode auto"),
])
def test_main_ppo_exits_with_one_line_before_ray(override, message):
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES), "--config-name", "tiny_cpu",
           "actor_rollout_ref.actor.hilore.enable=true", *override.split()]
    proc = harness.run(cmd, timeout_s=300)  # a check that let Ray start would leave nothing behind
    ours = [line for line in proc.stderr.splitlines() if line.startswith("hilore-verl:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith(f"hilore-verl: bad config: {message}"), proc.stderr[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == ours[0]  # no stack trace after it
    assert "ray init" not in proc.stdout and "Traceback" not in proc.stderr


def _cohere(path) -> str:
    """A family with no declared map whose blocks the name guess cannot complete (one norm feeds both
    the attention and the MLP): `attach` refuses it."""
    from transformers import CohereConfig

    CohereConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 architectures=["CohereForCausalLM"]).save_pretrained(path)  # verl picks the class by it
    return str(path)


def test_a_model_no_unit_map_fits_stops_main_ppo_before_ray(tmp_path):
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES), "--config-name", "tiny_cpu",
           "actor_rollout_ref.actor.hilore.enable=true", f"actor_rollout_ref.model.path={_cohere(tmp_path)}"]
    proc = harness.run(cmd, timeout_s=300)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("hilore-verl:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(ours) == 1 and "cannot map decoder block CohereDecoderLayer" in ours[0], proc.stderr[-3000:]
    assert "actor_rollout_ref.model.external_lib" in ours[0]
    assert "ray init" not in proc.stdout and "Traceback" not in proc.stderr


def test_the_unit_map_check_takes_a_users_map_from_external_lib(tmp_path, monkeypatch):
    from hilore_verl.integration.actor.map_check import check_unit_map
    from hilore_verl.model.unit_maps import MAPS

    model = _cohere(tmp_path / "cohere")
    with pytest.raises(ValueError, match="no module found for mlp.norm.*external_lib"):
        check_unit_map({"path": model})
    (tmp_path / "cohere_units.py").write_text(  # a user's module with the map (tested exact in test_unit_maps)
        "from hilore_verl.model.unit_maps import register_map\n"
        "from tests.model.test_unit_maps_on_cpu import COHERE_MAP\n"
        "register_map('cohere', COHERE_MAP)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        check_unit_map({"path": model, "external_lib": "cohere_units"})  # the user's map: accepted
    finally:
        MAPS.pop("cohere", None)
    check_unit_map({"path": str(tmp_path)})  # a folder without config.json: the engine checks at start-up


def test_the_unit_map_check_reads_a_hub_id_from_the_hub(tmp_path, monkeypatch):
    """A hub model id (not a local folder) is read through transformers, as verl's workers read it; where the
    hub cannot be reached the engine checks at start-up instead."""
    import transformers

    from hilore_verl.integration.actor.map_check import check_unit_map

    cohere, real = _cohere(tmp_path / "cohere"), transformers.AutoConfig.from_pretrained
    asked = []

    def from_hub(name, **kwargs):
        asked.append(name)
        if name == "some-org/cohere-like":
            return real(cohere)
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {name}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_hub)
    with pytest.raises(ValueError, match="cannot map decoder block CohereDecoderLayer"):
        check_unit_map({"path": "some-org/cohere-like"})
    check_unit_map({"path": "some-org/unreachable"})  # no hub: logged, checked by the engine
    assert asked == ["some-org/cohere-like", "some-org/unreachable"]


def test_only_hilore_errors_are_shortened():
    try:
        try:
            raise ValueError("hilore.group_size: got 3; valid: an integer, one of (32, 64, 128)")
        except ValueError as inner:
            raise RuntimeError("Error in call to target 'HiLoReActorConfig'") from inner
    except RuntimeError as outer:
        assert hilore_error(outer) == "hilore.group_size: got 3; valid: an integer, one of (32, 64, 128)"
    assert hilore_error(ValueError("train_batch_size must be divisible")) is None


def test_host_checks():
    from omegaconf import OmegaConf

    def config(**trainer):
        return OmegaConf.create({"trainer": {"device": "cpu", "nnodes": 1, "n_gpus_per_node": 2, **trainer},
                                 "actor_rollout_ref": {"rollout": {"name": "hf"}},
                                 "transfer_queue": {"enable": True,
                                                    "backend": {"SimpleStorage": {"num_data_storage_units": 8}}},
                                 "ray_kwargs": {"ray_init": {"num_cpus": None}}})

    too_few = os.cpu_count() < 12
    assert (host_error(config()) is not None) == too_few  # 2 ranks + controller + 8 units + 1
    assert host_error(config(nnodes=2)) is None  # other nodes' cores are not this host's
    with_cpus = config()
    with_cpus.ray_kwargs.ray_init.num_cpus = 16
    assert host_error(with_cpus) is None
    assert "use vllm or sglang" in host_error(config(device="cuda"))


def test_the_shared_prompt_note_names_verls_balance_over_ranks():
    from omegaconf import OmegaConf

    from hilore_verl.integration.actor.config_check import shared_prompt_note

    def config(hilore=None, n=8, ranks=2, **extra):
        actor = {"hilore": {"enable": True, **(hilore or {})}, **extra.pop("actor", {})}
        return OmegaConf.create({"trainer": {"n_gpus_per_node": ranks, "nnodes": 1, **extra},
                                 "actor_rollout_ref": {"actor": actor, "rollout": {"n": n}}})

    assert "use_prefix_grouper=true" in shared_prompt_note(config())  # verl's default balance_batch: true
    assert shared_prompt_note(config(actor={"use_prefix_grouper": True})) is None
    assert "use_prefix_grouper=true" in shared_prompt_note(config(balance_batch=False))  # v1 reads no balance_batch
    assert shared_prompt_note(config(balance_batch=False, use_v1=False)) is None  # the legacy trainer does
    assert "balance_batch=false" in shared_prompt_note(config(use_v1=False))
    assert shared_prompt_note(config(ranks=1)) is None and shared_prompt_note(config(n=1)) is None
    assert shared_prompt_note(config({"shared_prompt": False})) is None
    assert shared_prompt_note(config({"enable": False})) is None


def test_verls_legacy_balance_keeps_each_group_on_one_rank_under_use_prefix_grouper():
    """What the recipes rely on under `trainer.use_v1=false` (verl 0.9.1's legacy `_balance_batch`): with the
    flag every prompt's responses land on one rank, in their order; without it they spread over the ranks.
    The v1 trainer: tests/integration/test_group_balance_on_cpu.py."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from omegaconf import OmegaConf

    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    g = torch.Generator().manual_seed(0)
    groups, n, ranks = 8, 4, 2
    lengths = torch.randint(8, 40, (groups * n,), generator=g)
    mask = (torch.arange(48)[None, :] < lengths[:, None]).long()
    uid = np.array([f"p{i // n}" for i in range(groups * n)], dtype=object)

    def ranks_of(grouper: bool) -> list[np.ndarray]:
        batch = DataProto.from_dict(tensors={"attention_mask": mask.clone()}, non_tensors={"uid": uid.copy()})
        trainer = SimpleNamespace(use_prefix_grouper=grouper, _get_dp_size=lambda *a, **k: ranks, actor_rollout_wg=None,
                                  config=OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}}}))
        RayPPOTrainer._balance_batch(trainer, batch, metrics={})
        return np.split(batch.non_tensor_batch["uid"], ranks)  # verl's dispatch: equal contiguous chunks

    parts = ranks_of(True)
    assert sorted(len(part) for part in parts) == [groups * n // ranks] * ranks
    for part in parts:  # whole groups, each contiguous
        assert all((part == u).sum() == n for u in set(part))
        assert all(len(set(part[i:i + n])) == 1 for i in range(0, len(part), n))
    spread = ranks_of(False)
    assert any((part == u).sum() < n for part in spread for u in set(part))  # stock balance splits groups


def test_main_ppo_prints_the_note_once_before_it_validates():
    """The wiring: the note comes from verl's own trainer, once, before the config's own check (a bad key
    here, so the run stops before Ray)."""
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES), "--config-name", "tiny_cpu",
           "actor_rollout_ref.actor.hilore.enable=true", "actor_rollout_ref.actor.use_prefix_grouper=false",
           "actor_rollout_ref.actor.hilore.risk_budget=-1"]
    proc = harness.run(cmd, timeout_s=300)
    notes = [line for line in proc.stderr.splitlines() if line.startswith("hilore-verl: note: ")]
    assert proc.returncode == 2 and len(notes) == 1 and "use_prefix_grouper=true" in notes[0], proc.stderr[-3000:]
