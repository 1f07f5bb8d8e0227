"""Model configs (architecture only, no weights) that `hilore-verl plan --model` accepts by name.

Data only: imports nothing of hilore_verl.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

HERE = Path(__file__).parent
PRESETS = sorted(p.stem for p in HERE.glob("*.json"))


def load_config(model: str):
    """A transformers config from a preset name, a directory holding config.json, or a config.json path."""
    from transformers import AutoConfig, PretrainedConfig

    if model in PRESETS:
        fields = json.loads((HERE / f"{model}.json").read_text())
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(model)
    if path.is_file():
        return PretrainedConfig.from_json_file(os.fspath(path)) if path.suffix == ".json" else _fail(model)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"cannot read a model config from {model!r}: the directory has no config.json; "
                             f"pass a preset ({', '.join(PRESETS)}) or a Hugging Face model directory")
        return AutoConfig.from_pretrained(os.fspath(path))
    return _fail(model)


def _fail(model: str):
    raise ValueError(f"cannot read a model config from {model!r}: not a preset and not a directory with config.json; "
                     f"presets: {', '.join(PRESETS)}")
