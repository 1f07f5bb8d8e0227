#!/usr/bin/env bash
# A/B on a GPU node: the Qwen2.5-0.5B GSM8K recipe for a few steps with HiLoRe and with verl's GC,
# same seed, then a table of actor-update time and peak memory from verl's own metrics.
#   recipes/grpo/gpu_ab_0.5b.sh [STEPS=5] [NGPUS=all of the node's]    (needs verl[vllm], the model and the data)
# Writes logs to runs/ab_0.5b/ and the table to docs/benchmarks/recipe_qwen2.5-0.5b_gpu.md.
# A comparison of speed at the same update: HiLoRe's plans exact (risk_budget 0: keep / recompute only)
# and the solver's plans always run (measure_baseline false: no step falls back to GC's own plan);
# each arm its own experiment name, never resumed from a checkpoint (resume_mode disable). Peak memory
# alike: HILORE_VERL_PEAK_PER_MINI_BATCH=1 makes verl's own engine reset the device's peak counter as
# each mini-batch starts, as HiLoRe's engine does, so both arms' perf/max_memory_allocated_gb is one
# mini-batch's peak (hilore_verl/integration/tools/ab_peak.py).
set -euo pipefail
export HILORE_VERL_PEAK_PER_MINI_BATCH=1
steps="${1:-5}"
ngpus="${2:-$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)}"
here="$(cd "$(dirname "$0")" && pwd)"; root="$(cd "$here/../.." && pwd)"
out="$root/runs/ab_0.5b"; mkdir -p "$out"
[[ -f "$HOME/data/gsm8k/train.parquet" ]] || "$here/prepare_data.sh"
for method in gc hilore; do
  extra=()
  [[ "$method" == hilore ]] && extra=(actor_rollout_ref.actor.hilore.risk_budget=0
                                      actor_rollout_ref.actor.hilore.measure_baseline=false)
  echo "== $method: $steps steps on $ngpus GPU(s)"
  "$here/run.sh" qwen2.5-0.5b_gsm8k "$method" trainer.total_training_steps="$steps" trainer.n_gpus_per_node="$ngpus" \
    trainer.test_freq=-1 trainer.save_freq=-1 trainer.val_before_train=false data.seed=1 \
    trainer.experiment_name="ab_0.5b_${method}" trainer.resume_mode=disable "${extra[@]}" 2>&1 | tee "$out/$method.log"
done
python3 - "$out" "$root/docs/benchmarks/recipe_qwen2.5-0.5b_gpu.md" "$steps" "$ngpus" <<'PY'
import re, sys, statistics, subprocess
out, report, steps, ngpus = sys.argv[1:]
def series(log, key):
    return [float(m) for m in re.findall(re.escape(key) + r":([-0-9.e+]+)", open(log).read())]
def mean_after_first(log, key):
    values = series(log, key)
    return statistics.mean(values[1:] or values) if values else float("nan")
rows = []
for method in ("gc", "hilore"):
    log = f"{out}/{method}.log"
    peaks = series(log, "perf/max_memory_allocated_gb")
    rows.append((method, mean_after_first(log, "timing_s/update_actor"),
                 mean_after_first(log, "timing_per_token_ms/update_actor"), max(peaks) if peaks else float("nan")))
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
lines = [f"# Qwen2.5-0.5B GSM8K recipe: HiLoRe vs verl GC ({gpu.splitlines()[0] if gpu else 'GPU'}, {ngpus} GPU)", "",
         f"Command: `recipes/grpo/gpu_ab_0.5b.sh {steps} {ngpus}`; mean of steps 2..{steps}; HiLoRe exact "
         "(risk_budget 0) and its plans always run (measure_baseline false).", "",
         "| method | update_actor s | ratio to GC | per token ms | ratio to GC | peak allocated GiB | ratio to GC |",
         "|---|---|---|---|---|---|---|"]
for method, t, per, peak in rows:
    lines.append(f"| {method} | {t:.2f} | {t / rows[0][1]:.3f} | {per:.4f} | {per / rows[0][2]:.3f} | "
                 f"{peak:.2f} | {peak / rows[0][3]:.3f} |")
lines += ["", "Peak: the largest `perf/max_memory_allocated_gb` over the steps, one mini-batch's peak in both arms "
          "(HILORE_VERL_PEAK_PER_MINI_BATCH=1: verl's engine resets the counter as each mini-batch starts, as "
          "HiLoRe's does)."]
open(report, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
