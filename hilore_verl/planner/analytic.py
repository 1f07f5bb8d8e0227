"""A cost table from the model config alone: the model on the meta device, no data, no GPU.

Saved bytes come from the runtime's own accounting of a meta-device forward of the decoder layers
and head (exact shapes, no compute), except the attention core: on meta, SDPA takes its math path
(T x T scores), so a fused kernel's saves are used (q, k, v, output, fp32 logsumexp). Times are
estimates from FLOPs and bytes:

    projections   2 * tokens * sum(in * out) / flops_per_s                    (routers, shared experts too)
    experts       2 * tokens * (expert weights) * top_k / experts / flops_per_s     (active parameters)
    attention     4 * tokens * seq_len * heads * head_dim / flops_per_s (causal: half of 8)
    norms, act    2 * saved bytes / bytes_per_s                                (memory-bound)
    head          2 * tokens * hidden * vocab / flops_per_s
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, PretrainedConfig

import hilore_verl
from hilore_verl.planner.costs import CostTable, UnitProfile, payload_ratio  # noqa: F401
from hilore_verl.model.units import RecoveryUnit


def _meta_forward(model: nn.Module, runtime, tokens: int, dtype: torch.dtype) -> None:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    # not a leaf: a cast of a leaf that requires grad reads as a weight's autocast copy (saving.parameter_kind),
    # and the first norm's fp32 cast of its input would go uncounted
    hidden = torch.empty(1, tokens, model.config.hidden_size, device="meta", dtype=dtype, requires_grad=True).clone()
    positions = torch.arange(tokens, device="meta")[None]
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types is not None and "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters:
        # a rotary table per attention type (Gemma-3: local and global layers)
        tables = {t: inner.rotary_emb(hidden, positions, t) for t in set(layer_types)}
        cos_sin = [tables[t] for t in layer_types]
    else:
        cos_sin = [inner.rotary_emb(hidden, positions)] * len(inner.layers)
    with runtime.tracking():
        h = hidden
        for layer, table in zip(inner.layers, cos_sin):
            out = layer(h, attention_mask=None, position_embeddings=table, position_ids=positions, use_cache=False)
            h = out[0] if isinstance(out, tuple) else out
        logits = model.get_output_embeddings()(inner.norm(h))
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:  # the model's own code after lm_head (Gemma-2), the head's as in training: tanh saves its output
            torch.tanh(logits / cap) * cap


def _granite_router(router: nn.Module, hidden: torch.Tensor):
    """GraniteMoE's top-k router with the outputs of its own forward, for the meta device: its split
    sizes are counts read with `.tolist()` on a real device; here the tokens split evenly over the
    experts, as the FLOP estimate assumes (top_k / experts of the expert weights per token)."""
    logits = router.layer(hidden).float()  # [tokens, experts]
    top_logits, top_experts = logits.topk(router.top_k, dim=1)  # [tokens, k]
    gates = torch.softmax(top_logits, dim=1).type_as(hidden)
    order = top_experts.flatten().sort(0)[1]  # [tokens * k]: (token, slot) pairs grouped by expert
    total, experts = order.shape[0], router.num_experts
    sizes = [total // experts + (i < total % experts) for i in range(experts)]
    return order, order.div(router.top_k, rounding_mode="trunc"), gates.flatten()[order], sizes, logits


META_ROUTERS = {"GraniteMoeTopKGating": _granite_router}
"""Router classes whose forward reads tensor values (which the meta device does not have), by class
name: a stand-in with the same outputs and an even split, used by the analytic model only."""


def _meta_forward_or_refuse(model: nn.Module, runtime, tokens: int, dtype: torch.dtype) -> None:
    """`_meta_forward`, or one ValueError when the model's forward reads tensor values, which meta
    tensors do not have (e.g. a router that takes its split sizes with `.tolist()` and has no stand-in
    in META_ROUTERS)."""
    try:
        _meta_forward(model, runtime, tokens, dtype)
    except (NotImplementedError, RuntimeError) as err:
        if "meta" not in str(err):
            raise
        raise ValueError(f"{type(model).__name__} ({model.config.model_type}) has no analytic estimate: its forward "
                         f"reads tensor values, which the meta device does not have ({str(err).splitlines()[0]}). "
                         "Training with hilore.enable=true measures its costs on the device at the first "
                         "train_batch instead.") from err


def moe_routing(config: PretrainedConfig) -> tuple[int, int] | None:
    """(routed experts, experts per token) of an MoE config, or None for a dense one."""
    experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, k, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if experts and top_k else None


def _weights(unit: RecoveryUnit) -> int:
    """Matrix (and expert-stacked) parameters of a unit's modules: what its matmuls multiply by."""
    return sum(p.numel() for m in unit.modules for p in m.parameters() if p.dim() >= 2)


def active_parameters(model: nn.Module) -> int:
    """Parameters one token runs through: every parameter, less the routed experts it is not sent to."""
    from hilore_verl.model.units import find_units

    total = sum(p.numel() for p in model.parameters())
    routing = moe_routing(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config)
    if routing is None:
        return total
    experts, top_k = routing
    routed = sum(p.numel() for u in find_units(model) if u.kind == "experts" for m in u.modules for p in m.parameters())
    return int(total - routed * (1 - top_k / experts))


def _unit_flops(unit: RecoveryUnit, tokens: int, seq_len: int, config: PretrainedConfig) -> float:
    if unit.kind in ("proj", "router", "shared_experts"):  # every token through every weight
        return 2.0 * tokens * _weights(unit)
    if unit.kind == "experts":  # each token through its top-k experts only: the active parameters
        experts, top_k = moe_routing(config) or (1, 1)
        return 2.0 * tokens * _weights(unit) * top_k / experts
    if unit.kind == "attn_core":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 4.0 * tokens * seq_len * config.num_attention_heads * head_dim
    if unit.kind == "head":
        return 2.0 * tokens * config.hidden_size * config.vocab_size
    return 0.0


def _fused_attention_saved(config: PretrainedConfig, tokens: int, element: int) -> float:
    """What a fused attention kernel saves: rotated q and k, v, the output, and an fp32 logsumexp."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = getattr(config, "num_key_value_heads", config.num_attention_heads) * head_dim
    return tokens * ((2 * q + 2 * kv) * element + 4 * config.num_attention_heads)


def analytic_costs(config: PretrainedConfig, tokens: int, seq_len: int, dtype: torch.dtype = torch.bfloat16,
                   flops_per_s: float = 400e12, bytes_per_s: float = 3e12, **kwargs) -> CostTable:
    """CostTable for `tokens` tokens per micro-batch in sequences of about `seq_len`, from the config."""
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").train()
        except ValueError:  # a family transformers runs in eager attention only (GPT-OSS's sinks)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").train()
    for module in model.modules():  # before attach, whose wrappers then run the stand-ins
        router = META_ROUTERS.get(type(module).__name__)
        if router is not None:
            module.forward = types.MethodType(router, module)
    runtime = hilore_verl.attach(model, hilore_verl.RuntimeConfig(min_bytes=0))
    try:
        _meta_forward_or_refuse(model, runtime, tokens, dtype)
        keep = runtime.stats()
        kinds: dict[str, list[str]] = {}
        for u in runtime.units:
            kinds.setdefault(u.group, []).append(u.name)
        held: dict[str, float] = {}
        for names in kinds.values():
            runtime.set_plan({n: "recompute" for n in names})
            _meta_forward_or_refuse(model, runtime, tokens, dtype)
            held.update({n: runtime.stats().units[n].stored_bytes for n in names})
        element = torch.tensor([], dtype=dtype).element_size()
        units = []
        for u in runtime.units:
            saved = keep.units[u.name].saved_bytes
            if u.kind == "attn_core":  # meta tensors run SDPA's math path (T x T scores): use the fused kernel's saves
                saved = _fused_attention_saved(config, tokens, element)
            seconds = max(_unit_flops(u, tokens, seq_len, config) / flops_per_s, 2 * saved / bytes_per_s)
            units.append(UnitProfile(u.name, saved, held[u.name], seconds))
        return CostTable(units, tokens, keep.unmanaged_bytes, element, codec_bytes_per_s=bytes_per_s,
                         host_bytes_per_s=kwargs.pop("host_bytes_per_s", 50e9), **kwargs)
    finally:
        runtime.detach()
