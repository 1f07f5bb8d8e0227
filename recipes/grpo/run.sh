#!/usr/bin/env bash
# Run one GRPO recipe with one actor-update method (verl 0.9.1's main_ppo, this directory's YAMLs).
#   recipes/grpo/run.sh RECIPE METHOD [hydra overrides...]
#   RECIPE: qwen2.5-{0.5b,1.5b,7b}_{gsm8k,math}     METHOD: hilore | gc | offload
#     hilore   HiLoRe on the actor (actor_rollout_ref.actor.hilore.enable=true)
#     gc       verl's full gradient checkpointing (the recipe's baseline)
#     offload  verl's activation offload on top of gradient checkpointing
# The A/B pairs: `hilore` vs `gc`, and `hilore` vs `offload`, same recipe, same seed.
# `+variant=no_kl` among the overrides: the same recipe without the KL loss (variant/no_kl.yaml).
set -euo pipefail
if [[ $# -lt 2 ]]; then sed -n '2,9p' "$0"; exit 2; fi
recipe="$1"; method="$2"; shift 2
here="$(cd "$(dirname "$0")" && pwd)"
[[ -f "$here/$recipe.yaml" ]] || { echo "no recipe $recipe; have: $(cd "$here" && ls qwen*.yaml | sed 's/.yaml//' | tr '\n' ' ')"; exit 2; }
case "$method" in
  hilore)  flags=(actor_rollout_ref.actor.hilore.enable=true) ;;
  gc)      flags=() ;;
  offload) flags=(actor_rollout_ref.model.enable_activation_offload=true) ;;
  *) echo "unknown method $method; use hilore, gc or offload"; exit 2 ;;
esac
exec python3 -m verl.trainer.main_ppo --config-path "$here" --config-name "$recipe" \
  "${flags[@]}" trainer.experiment_name="${recipe}_${method}" "$@"
