"""What every stage of the check is given and writes to, and the helpers two stages share.

`Context` says where a stage runs (device, tiny sizes, output folder); `StageReport` records its checks
(pass / fail with a detail line) and figures, rewriting its JSON file after every record so that what
was measured survives a stage killed at its time limit. The stages (stages.py, shared.py, model.py,
profile_stage.py) import this module; stage.py, which runs them, imports them: no circle.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Context:
    device: str  # "cuda" or "cpu"
    tiny: bool  # the CPU-sized version of every workload
    out: str

    def torch_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")


class StageReport:
    def __init__(self, path: str):
        self.path = path
        self.data = {"checks": [], "figures": {}}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.write()
        return bool(ok)

    def figure(self, key: str, value) -> None:
        self.data["figures"][key] = value
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


def tiny_policy(ctx: Context):
    """A Qwen2-shaped policy with random weights (bf16 on CUDA), tiny on the CPU; and its vocabulary size."""
    from hilore_verl.tiny.models import build_tiny_model

    size = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=512) if ctx.tiny else \
        dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8192)
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    return build_tiny_model("qwen2", dtype=dtype, **size).to(ctx.torch_device()).train(), size["vocab_size"]


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """Cosine and relative error of gradients `a` against the reference `b` (float64)."""
    x = torch.cat([g.flatten().double() for g in a])
    y = torch.cat([g.flatten().double() for g in b])
    return float(x @ y / (x.norm() * y.norm())), float((x - y).norm() / y.norm())
