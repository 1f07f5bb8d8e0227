"""Recovery units of a Hugging Face decoder-only causal LM (plain or FSDP2-wrapped).

A unit owns the saved tensors *produced* by its modules. Per decoder layer i:

    layers.i.attn.norm   input_layernorm                 kind "norm"       cheap to recompute
    layers.i.attn.proj   q/k/v/o projections (Linear)    kind "proj"       matmul outputs: costly to recompute
    layers.i.attn.core   the attention module's own code kind "attn_core"  rope, q/k norms, SDPA output + lse
    layers.i.mlp.norm    post_attention_layernorm        kind "norm"
    layers.i.mlp.proj    gate/up/down projections        kind "proj"
    layers.i.mlp.act     the MLP module's own code       kind "act"        activation function and gating product
    head                 final norm and lm_head          kind "head"

That is the map of the pre-norm families (Qwen2/2.5/3, Llama, Mistral). Other families have their
own (unit_maps.py): norms after the sub-block (OLMo-2) or on both sides (Gemma-2/3), fused
projections (Phi-3), and MoE layers, whose MLP splits into mlp.router (kind "router"),
mlp.experts ("experts"), mlp.shared ("shared_experts", where the family has them) and the MoE
block's own code (mlp.act).

"Own code" means the module's forward minus the children that belong to another unit: the
attention module's own code is everything between its projections (RoPE, q/k norms, SDPA).
Each unit lists the modules whose forward it owns; a plan may address a unit by name or a group
by prefix ("layers.3", "layers.3.attn").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from hilore_verl.model.unit_maps import KINDS, guess_map, map_for, resolve_block  # noqa: F401  (KINDS: re-exported)


@dataclass(eq=False)
class RecoveryUnit:
    name: str
    kind: str
    layer_index: int | None  # None for the head
    modules: list[nn.Module] = field(default_factory=list, repr=False)
    block: nn.Module | None = field(default=None, repr=False)  # the decoder block it belongs to
    index: int = -1  # position in the runtime's unit list
    group: str = ""
    """Units that share shapes, costs and calibration: the name within the layer ("mlp.act"), with the
    layer variant appended where layers differ ("mlp.act/v1": e.g. an MoE layer after dense ones)."""

    def __repr__(self) -> str:
        return f"RecoveryUnit({self.name!r}, kind={self.kind!r}, modules={len(self.modules)})"


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


def name_in_layer(name: str) -> str:
    """The name within the layer: "attn.norm" for "layers.3.attn.norm"; the head is its own."""
    return name.split(".", 2)[-1] if name.startswith("layers.") else name


def representatives(names: list[str], groups: dict[str, str] | None = None) -> dict[str, str]:
    """One unit per group (default: per name within the layer), from the middle one of the decoder
    layers that have the group (the head as itself): group -> unit name."""
    groups = groups or {n: name_in_layer(n) for n in names}
    layers: dict[str, list[int]] = {}
    for n in names:
        if n.startswith("layers."):
            layers.setdefault(groups[n], []).append(int(n.split(".")[1]))
    out = {}
    for n in names:
        g = groups[n]
        if not n.startswith("layers."):
            out.setdefault(g, n)
        elif int(n.split(".")[1]) == sorted(layers[g])[len(layers[g]) // 2]:
            out.setdefault(g, n)
    return out


def find_units(model: nn.Module) -> list[RecoveryUnit]:
    """The model's recovery units in forward order, each with a stable name, from its family's unit
    map (unit_maps.py); ValueError, before anything is changed, when a block is not mapped completely."""
    layers, final_norm, lm_head = _find_decoder(model)
    specs, source = map_for(model)
    units: list[RecoveryUnit] = []
    variants: dict[tuple, int] = {}  # layer signature (its units and their module types) -> variant number
    for i, block in enumerate(layers):
        found = resolve_block(block, specs or guess_map(block), f"layers.{i}", source, every_unit=not specs)
        signature = (type(block).__name__, tuple((spec.name, tuple(type(m).__name__ for m in modules))
                                                 for spec, modules in found))
        variant = variants.setdefault(signature, len(variants))
        for spec, modules in found:
            units.append(RecoveryUnit(f"layers.{i}.{spec.name}", spec.kind, i, modules, block,
                                      group=spec.name if variant == 0 else f"{spec.name}/v{variant}"))
    head_modules = [m for m in (final_norm, lm_head) if m is not None]
    if head_modules:
        units.append(RecoveryUnit("head", "head", None, head_modules, group="head"))
    for i, unit in enumerate(units):
        unit.index = i
    return units
