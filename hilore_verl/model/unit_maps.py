"""Unit maps: which modules of a decoder block make each recovery unit, declared per model family.

A map is a list of units, each a name within the layer, a kind and module paths relative to the
block. A unit owns its modules' calls and every call inside them that no other unit owns, so
"self_attn" as the attention core means the attention module's own code (RoPE, q/k norms, SDPA)
once its projections are a unit of their own. Paths absent from a block are skipped, so one map
covers a family's dense and MoE layers (DeepSeek-V3's first layers, Qwen3-MoE's `mlp_only_layers`).

The map is chosen by the model config's `model_type` (`MAPS`); `register_map` adds one. A model
type without a map falls back to matching child names (`guess_map`), and any map, declared or
guessed, is used only once `resolve_block` proves it complete on the block it is applied to:

  - every parameter of the block sits under a unit's modules (nothing unmanaged);
  - no module in two units; a guessed map finds every one of its units;
  - (at the first profiled forward: every unit's modules ran; planner/profiling.py)

Otherwise `attach` raises one ValueError naming the block class, its children and how to add a
map, and changes nothing on the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

KINDS = ("norm", "proj", "attn_core", "act", "router", "experts", "shared_experts", "head")


@dataclass(frozen=True)
class UnitSpec:
    name: str  # within the layer: "attn.proj" -> unit "layers.3.attn.proj"
    kind: str
    paths: tuple[str, ...]  # module paths relative to the decoder block


def _spec(name: str, kind: str, *paths: str) -> UnitSpec:
    return UnitSpec(name, kind, paths)


def _attention(proj=("q_proj", "k_proj", "v_proj", "o_proj"), attn="self_attn") -> list[UnitSpec]:
    return [_spec("attn.proj", "proj", *(f"{attn}.{p}" for p in proj)), _spec("attn.core", "attn_core", attn)]


def _dense_mlp(proj=("gate_proj", "up_proj", "down_proj"), mlp="mlp") -> list[UnitSpec]:
    return [_spec("mlp.proj", "proj", *(f"{mlp}.{p}" for p in proj)), _spec("mlp.act", "act", mlp)]


def _moe(router: str, experts: tuple[str, ...], shared: str | None = None, mlp: str = "mlp") -> list[UnitSpec]:
    """Router, routed experts and shared experts as units of their own kinds; the MoE block's own code
    (dispatch, weighting, the sum over experts) is "mlp.act", as a dense MLP's own code is."""
    units = [_spec("mlp.router", "router", f"{mlp}.{router}"),
             _spec("mlp.experts", "experts", *(f"{mlp}.{e}" for e in experts))]
    if shared is not None:
        units.append(_spec("mlp.shared", "shared_experts", f"{mlp}.{shared}"))
    return units + [_spec("mlp.act", "act", mlp)]


ATTN_PRE_NORM = [_spec("attn.norm", "norm", "input_layernorm"), *_attention(),
                 _spec("mlp.norm", "norm", "post_attention_layernorm")]
DENSE_PROJ = _spec("mlp.proj", "proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PRE_NORM = [*ATTN_PRE_NORM, *_dense_mlp()]

MAPS: dict[str, list[UnitSpec]] = {
    # pre-norm blocks: norm, attention, norm, gated MLP
    "qwen2": PRE_NORM,
    "qwen3": PRE_NORM,
    "llama": PRE_NORM,
    "mistral": PRE_NORM,
    # Phi-3: fused projections; each residual dropout joins the sub-block it follows
    "phi3": [_spec("attn.norm", "norm", "input_layernorm"),
             _spec("attn.proj", "proj", "self_attn.qkv_proj", "self_attn.o_proj"),
             _spec("attn.core", "attn_core", "self_attn", "resid_attn_dropout"),
             _spec("mlp.norm", "norm", "post_attention_layernorm"),
             _spec("mlp.proj", "proj", "mlp.gate_up_proj", "mlp.down_proj"),
             _spec("mlp.act", "act", "mlp", "resid_mlp_dropout")],
    # OLMo-2: post-norm, each norm after its sub-block
    "olmo2": [*_attention(), _spec("attn.norm", "norm", "post_attention_layernorm"),
              *_dense_mlp(), _spec("mlp.norm", "norm", "post_feedforward_layernorm")],
    # Gemma-2 / Gemma-3: a norm before and after each sub-block
    "gemma2": [_spec("attn.norm", "norm", "input_layernorm", "post_attention_layernorm"), *_attention(),
               _spec("mlp.norm", "norm", "pre_feedforward_layernorm", "post_feedforward_layernorm"), *_dense_mlp()],
    # MoE families; a layer with a dense MLP (DeepSeek-V3's first layers, Qwen3-MoE's mlp_only_layers)
    # has mlp.proj instead of router and experts
    "qwen3_moe": [*ATTN_PRE_NORM, DENSE_PROJ, *_moe("gate", ("experts",))],
    "mixtral": [*ATTN_PRE_NORM, *_moe("gate", ("experts",))],
    "gpt_oss": [*ATTN_PRE_NORM, *_moe("router", ("experts",))],
    "deepseek_v3": [_spec("attn.norm", "norm", "input_layernorm"),
                    *_attention(proj=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")),
                    _spec("mlp.norm", "norm", "post_attention_layernorm"), DENSE_PROJ,
                    *_moe("gate", ("experts",), shared="shared_experts")],
    "granitemoe": [*ATTN_PRE_NORM, *_moe("router", ("input_linear", "output_linear"), mlp="block_sparse_moe")],
}
MAPS["gemma3_text"] = MAPS["gemma2"]


def register_map(model_type: str, units: list[UnitSpec]) -> None:
    """Declare the unit map of a model family (HF config `model_type`); it is checked like any other."""
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError(f"unit map for {model_type!r} names a unit twice: {names}")
    bad = [u.kind for u in units if u.kind not in KINDS]
    if bad:
        raise ValueError(f"unit map for {model_type!r}: unknown kinds {bad}; kinds are {KINDS}")
    MAPS[model_type] = list(units)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


GUESSED = (("attn.norm", "norm"), ("attn.proj", "proj"), ("attn.core", "attn_core"), ("mlp.norm", "norm"),
           ("mlp.proj", "proj"), ("mlp.act", "act"))


def guess_map(block: nn.Module) -> list[UnitSpec]:
    """For a model type without a map: norms, attention (its Linear children as projections) and MLP
    from child names. Every unit of GUESSED must be found, and `resolve_block` must prove the whole
    map complete, or attach refuses the model."""
    attn = mlp = None
    norms = []
    for name, child in block.named_children():
        if _is_norm(child):
            norms.append(name)
        elif attn is None and ("attn" in name or "attention" in name):
            attn = (name, child)
        elif mlp is None and ("mlp" in name or "feed_forward" in name or "ffn" in name):
            mlp = (name, child)
    def projections(name: str, module: nn.Module) -> tuple[str, ...]:
        # nn.Linear, or an adapter wrapping one (peft's LoRA layers keep it as `base_layer`)
        return tuple(f"{name}.{n}" for n, c in module.named_children()
                     if isinstance(c, nn.Linear) or isinstance(getattr(c, "base_layer", None), nn.Linear))

    units = []
    if norms:
        units.append(_spec("attn.norm", "norm", norms[0]))
    if attn is not None:
        units += [_spec("attn.proj", "proj", *projections(*attn)), _spec("attn.core", "attn_core", attn[0])]
    if len(norms) > 1:
        units.append(_spec("mlp.norm", "norm", *norms[1:]))
    if mlp is not None:
        units += [_spec("mlp.proj", "proj", *projections(*mlp)), _spec("mlp.act", "act", mlp[0])]
    found = {u.name for u in units}
    units += [_spec(name, kind) for name, kind in GUESSED if name not in found]  # empty: resolve_block refuses it
    return units


def _children(block: nn.Module) -> str:
    return ", ".join(f"{n}: {type(c).__name__}" for n, c in block.named_children())


def resolve_block(block: nn.Module, specs: list[UnitSpec], where: str, source: str,
                  every_unit: bool = False) -> list[tuple[UnitSpec, list[nn.Module]]]:
    """Each unit of `specs` present in `block` with its modules, proven complete (see module docstring);
    ValueError naming what does not fit otherwise. `source`: where the map came from, for the message;
    `every_unit`: each unit must be present (a guessed map has no variants)."""
    modules = {name: m for name, m in block.named_modules() if name}
    found: list[tuple[UnitSpec, list[nn.Module]]] = []
    owner: dict[int, str] = {}  # id(module) -> unit name
    problems = []
    for spec in specs:
        present = [p for p in spec.paths if p in modules]
        if not present:
            if every_unit:
                problems.append(f"no module found for {spec.name}")
            continue  # a variant this block does not have (a dense layer's MLP in an MoE layer, ...)
        for p in present:
            if id(modules[p]) in owner:
                problems.append(f"{p} is in both {owner[id(modules[p])]} and {spec.name}")
            owner[id(modules[p])] = spec.name
        found.append((spec, [modules[p] for p in present]))
    if not found:
        problems.append("no unit of the map is in this block")
    # every parameter under a unit's module (the nearest one owns it)
    unmanaged = []
    for pname, _ in block.named_parameters():
        parts = pname.split(".")[:-1]
        if not any(id(modules.get(".".join(parts[:i]))) in owner for i in range(len(parts), 0, -1)):
            unmanaged.append(pname)
    if unmanaged:
        problems.append(f"parameters in no unit: {', '.join(unmanaged[:8])}{' ...' if len(unmanaged) > 8 else ''}")
    if problems:
        raise ValueError(
            f"hilore-verl cannot map decoder block {type(block).__name__} at {where} completely with {source}: "
            f"{'; '.join(problems)}. Its children: {_children(block)}. Nothing was attached and HF gradient "
            "checkpointing is unchanged. Declare the family's map with hilore_verl.model.unit_maps.register_map("
            "model_type, [UnitSpec(name, kind, paths), ...]) (see MAPS in hilore_verl/model/unit_maps.py for examples).")
    return found


def map_for(model: nn.Module) -> tuple[list[UnitSpec], str]:
    """The unit map for a model and where it came from (a declared family map, or a guess)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type in MAPS:
        return MAPS[model_type], f"the declared map for model_type {model_type!r}"
    return [], f"a map guessed from child names (no map is declared for model_type {model_type!r})"


__all__ = ["KINDS", "MAPS", "UnitSpec", "guess_map", "map_for", "register_map", "resolve_block"]
