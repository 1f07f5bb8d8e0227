#!/usr/bin/env bash
# GSM8K and MATH as verl's recipes expect them ($HOME/data/{gsm8k,math}/{train,test}.parquet), made by
# verl's own data-prep scripts from the verl release these recipes are pinned to (needs network).
set -euo pipefail
tag="${VERL_TAG:-v0.9.1}"
src="$(mktemp -d)/verl"
git clone --quiet --depth 1 --branch "$tag" https://github.com/volcengine/verl "$src"
python3 "$src/examples/data_preprocess/gsm8k.py" --local_save_dir "$HOME/data/gsm8k"
python3 "$src/examples/data_preprocess/math_dataset.py" --local_save_dir "$HOME/data/math"
ls -l "$HOME/data/gsm8k" "$HOME/data/math"
