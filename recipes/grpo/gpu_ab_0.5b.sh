#!/usr/bin/env bash
# A/B on a GPU node: the Qwen2.5-0.5B GSM8K recipe for a few steps with HiLoRe and with verl's GC,
# same seed, then a table of actor-update time and peak memory from verl's own metrics.
#   recipes/grpo/gpu_ab_0.5b.sh [STEPS=5] [NGPUS=1]    (needs verl[vllm], the model and the data)
# Writes logs to runs/ab_0.5b/ and the table to docs/benchmarks/recipe_qwen2.5-0.5b_gpu.md.
set -euo pipefail
steps="${1:-5}"; ngpus="${2:-1}"
here="$(cd "$(dirname "$0")" && pwd)"; root="$(cd "$here/../.." && pwd)"
out="$root/runs/ab_0.5b"; mkdir -p "$out"
[[ -f "$HOME/data/gsm8k/train.parquet" ]] || "$here/prepare_data.sh"
for method in gc hilore; do
  echo "== $method: $steps steps on $ngpus GPU(s)"
  "$here/run.sh" qwen2.5-0.5b_gsm8k "$method" trainer.total_training_steps="$steps" trainer.n_gpus_per_node="$ngpus" \
    trainer.test_freq=-1 trainer.save_freq=-1 trainer.val_before_train=false data.seed=1 2>&1 | tee "$out/$method.log"
done
python3 - "$out" "$root/docs/benchmarks/recipe_qwen2.5-0.5b_gpu.md" "$steps" "$ngpus" <<'PY'
import re, sys, statistics, subprocess
out, report, steps, ngpus = sys.argv[1:]
def series(log, key):
    return [float(m) for m in re.findall(re.escape(key) + r":([-0-9.e+]+)", open(log).read())]
rows, base = [], None
for method in ("gc", "hilore"):
    log = f"{out}/{method}.log"
    t = series(log, "timing_s/update_actor")[1:] or series(log, "timing_s/update_actor")
    mem = series(log, "perf/max_memory_allocated_gb")
    rows.append((method, statistics.mean(t), max(mem) if mem else float("nan")))
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
lines = [f"# Qwen2.5-0.5B GSM8K recipe: HiLoRe vs verl GC ({gpu}, {ngpus} GPU)", "",
         f"Command: `recipes/grpo/gpu_ab_0.5b.sh {steps} {ngpus}`; mean of steps 2..{steps}.", "",
         "| method | update_actor s | ratio to GC | peak allocated GiB | ratio to GC |", "|---|---|---|---|---|"]
for method, t, m in rows:
    lines.append(f"| {method} | {t:.2f} | {t / rows[0][1]:.3f} | {m:.2f} | {m / rows[0][2]:.3f} |")
open(report, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
