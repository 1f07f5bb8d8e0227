#!/usr/bin/env bash
# `hilore-verl bench` on one GPU with a real model architecture (random weights, no download):
# every method, the budget sweep, CUDA max_memory_allocated peaks. Writes
# docs/benchmarks/bench_gpu_<model>.md (command, versions, table), the full JSON and PNG, and
# appends the run to docs/benchmarks/data/bench_gpu.jsonl.
#   benchmarks/gpu_bench.sh [MODEL=qwen2.5-1.5b] [extra bench options...]
set -euo pipefail
model="${1:-qwen2.5-1.5b}"; shift || true
root="$(cd "$(dirname "$0")/.." && pwd)"; out="$root/docs/benchmarks"; mkdir -p "$out/data"
cli="${HILORE_CLI:-hilore-verl}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$cli" bench --model "$model" --groups 8 --group-size 8 --response-len 1024 --rounds 5 \
  --json "$out/data/bench_gpu_${model}.json" --plot "$out/bench_gpu_${model}.png" \
  --append "$out/data/bench_gpu.jsonl" "$@" | tee /tmp/bench_gpu_${model}.txt
{
  echo "# hilore-verl bench on $(python3 -c 'import torch; print(torch.cuda.get_device_name())'), $model"
  echo
  echo "Command: \`benchmarks/gpu_bench.sh $model $*\`; $(python3 -c 'import torch, verl; print("torch", torch.__version__, "verl", verl.__version__)'); $(date -u +%F)."
  echo
  echo '```'
  cat /tmp/bench_gpu_${model}.txt
  echo '```'
} > "$out/bench_gpu_${model}.md"
echo "wrote $out/bench_gpu_${model}.md"
