"""Recovery units of a Hugging Face decoder-only causal LM (plain or FSDP2-wrapped).

A unit owns the saved tensors *produced* by its modules. Per decoder layer i:

    layers.i.attn.norm   input_layernorm                 kind "norm"       cheap to recompute
    layers.i.attn.proj   q/k/v/o projections (Linear)    kind "proj"       matmul outputs: costly to recompute
    layers.i.attn.core   the attention module's own code kind "attn_core"  rope, q/k norms, SDPA output + lse
    layers.i.mlp.norm    post_attention_layernorm        kind "norm"
    layers.i.mlp.proj    gate/up/down projections        kind "proj"
    layers.i.mlp.act     the MLP module's own code       kind "act"        activation function and gating product
    head                 final norm and lm_head          kind "head"

"Own code" means the module's forward minus the children that belong to another unit: the
attention module's own code is everything between its projections (RoPE, q/k norms, SDPA).
Each unit lists the modules whose forward it owns; a plan may address a unit by name or a group
by prefix ("layers.3", "layers.3.attn").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

KINDS = ("norm", "proj", "attn_core", "act", "head")


@dataclass(eq=False)
class RecoveryUnit:
    name: str
    kind: str
    layer_index: int | None  # None for the head
    modules: list[nn.Module] = field(default_factory=list, repr=False)
    block: nn.Module | None = field(default=None, repr=False)  # the decoder block it belongs to
    index: int = -1  # position in the runtime's unit list

    def __repr__(self) -> str:
        return f"RecoveryUnit({self.name!r}, kind={self.kind!r}, modules={len(self.modules)})"


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _find_decoder(model: nn.Module) -> tuple[nn.ModuleList, nn.Module | None, nn.Module | None]:
    """(layers, final norm, lm_head) of a causal LM: `model.model.layers` or any `layers` ModuleList."""
    layers = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers" and len(module):
            layers = module
            break
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `layers` list of decoder blocks: not a supported "
                         "decoder-only model (Qwen2/2.5/3, Llama, Mistral and similar are)")
    parent = next(m for m in model.modules() if any(c is layers for c in m.children()))
    final_norm = getattr(parent, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return layers, final_norm, head


def _split_block(block: nn.Module, prefix: str, index: int) -> list[RecoveryUnit]:
    """Units of one decoder block, from its children: norms, attention (has q/k/v/o), MLP (the rest)."""
    attn = mlp = None
    norms = []
    for name, child in block.named_children():
        if _is_norm(child):
            norms.append((name, child))
        elif "attn" in name or "attention" in name:
            attn = child
        elif "mlp" in name or "feed_forward" in name or "ffn" in name:
            mlp = child
    if attn is None or mlp is None or len(norms) != 2:
        raise ValueError(f"decoder block {type(block).__name__} at {prefix} is not norm/attention/norm/MLP shaped; "
                         f"found children {[n for n, _ in block.named_children()]}")
    by_name = dict(norms)
    attn_norm = by_name.get("input_layernorm", norms[0][1])
    mlp_norm = by_name.get("post_attention_layernorm", norms[1][1])
    attn_proj = [c for c in attn.children() if isinstance(c, nn.Linear)]
    mlp_proj = [c for c in mlp.children() if isinstance(c, nn.Linear)]
    return [
        RecoveryUnit(f"{prefix}.attn.norm", "norm", index, [attn_norm]),
        RecoveryUnit(f"{prefix}.attn.proj", "proj", index, attn_proj),
        RecoveryUnit(f"{prefix}.attn.core", "attn_core", index, [attn]),
        RecoveryUnit(f"{prefix}.mlp.norm", "norm", index, [mlp_norm]),
        RecoveryUnit(f"{prefix}.mlp.proj", "proj", index, mlp_proj),
        RecoveryUnit(f"{prefix}.mlp.act", "act", index, [mlp]),
    ]


def unit_kind(name: str) -> str:
    """Units that share shapes across decoder layers: "attn.norm" for "layers.3.attn.norm"; the head is its own."""
    return name.split(".", 2)[-1] if name.startswith("layers.") else name


def representatives(names: list[str]) -> dict[str, str]:
    """One unit per kind, from the middle decoder layer (the head as itself): kind -> unit name."""
    layers = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    middle = f"layers.{layers[len(layers) // 2]}." if layers else None
    out = {}
    for n in names:
        if not n.startswith("layers.") or n.startswith(middle):
            out.setdefault(unit_kind(n), n)
    return out


def find_units(model: nn.Module) -> list[RecoveryUnit]:
    """The model's recovery units in forward order, each with a stable name."""
    layers, final_norm, lm_head = _find_decoder(model)
    units: list[RecoveryUnit] = []
    for i, block in enumerate(layers):
        for unit in _split_block(block, f"layers.{i}", i):
            unit.block = block
            units.append(unit)
    head_modules = [m for m in (final_norm, lm_head) if m is not None]
    if head_modules:
        units.append(RecoveryUnit("head", "head", None, head_modules))
    for i, unit in enumerate(units):
        unit.index = i
    return units
