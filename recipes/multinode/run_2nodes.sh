#!/usr/bin/env bash
# GRPO with HiLoRe on 2 nodes x 8 GPUs through Ray (verl 0.9.1).
# hilore-verl must be installed on every node (same version): verl imports its plugin in every Ray
# worker, and each actor worker resolves the recipe's `_target_` there. Nothing else to set up.
#
#   node 0:  recipes/multinode/run_2nodes.sh head            # starts the Ray head
#   node 1:  recipes/multinode/run_2nodes.sh worker HEAD_IP  # joins it
#   node 0:  recipes/multinode/run_2nodes.sh train [RECIPE] [overrides...]   (default qwen2.5-7b_math)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
case "${1:-}" in
  head)   ray start --head --port=6379 --num-gpus=8 ;;
  worker) ray start --address="${2:?HEAD_IP}:6379" --num-gpus=8 ;;
  train)
    shift; recipe="${1:-qwen2.5-7b_math}"; shift || true
    python3 -c "import hilore_verl, verl; print('hilore-verl', hilore_verl.__version__, 'verl', verl.__version__)"
    exec "$here/../grpo/run.sh" "$recipe" hilore trainer.nnodes=2 trainer.n_gpus_per_node=8 "$@" ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
