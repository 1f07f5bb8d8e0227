"""Shared-prompt attention as a transformers attention implementation, selected by name.

    with shared_attention(model), shared_layout(layout):
        out = model(input_ids=layout.input_ids, position_ids=layout.position_ids,
                    shared_prompt_layout=layout)      # the kwarg is optional inside shared_layout

`install(model)` switches the model's `config._attn_implementation` to `"hilore_shared_prompt+<base>"`,
`<base>` being the implementation it ran before (sdpa, eager, flash_attention_2, ...); `uninstall`
switches it back and `shared_attention(model)` does both around a block. The name is registered with
transformers' `AttentionInterface` and `AttentionMaskInterface`. An installed model stays exact on
ordinary inputs: without a layout, the attention and its mask are the base implementation's. With a
layout (the `shared_prompt_layout=` forward kwarg, which transformers hands down to every attention
call, or `shared_layout(layout)` around the forward) the attention serves the layout instead.

Mask plumbing: the model builds its masks (`masking_utils.create_causal_mask` and friends) before the
layers run and asks the mask function registered under the implementation's name. Inside
`shared_layout` that function returns None, so no [L, L] mask is built; the layout is the mask. Per
segment (see layout.py) one `scaled_dot_product_attention` call runs with a boolean [L_g, L_g] mask
(prompt causal; each response sees the prompt and its own earlier tokens), so cost and memory grow
with the segments, not with the row. Activation checkpointing recomputes each layer in the backward,
after `shared_layout` has exited: the recompute finds the layout in the kwargs the checkpoint kept
(pass `shared_prompt_layout=`), and the model must still be installed then.

Honoured: GQA (SDPA's grouped heads), `scaling`, `dropout`, `sliding_window` (keys less than
`sliding_window` positions behind, positions of the unshared sequence, as transformers' sliding
masks) and `softcap` (Gemma2's attention logit soft-capping, computed explicitly; over an sdpa base,
which ignores it, ignored too, so a model computes the same shared or not). Refused with
NotImplementedError, so callers fall back to the ordinary forward: attention sinks (`s_aux`,
GPT-OSS), non-causal attention, a KV cache, a layer whose sliding window is not passed to its
attention call, and a query that is not one row of the layout's length.

Kernels (`kernel_on(device)`): on CUDA one FlexAttention call over the whole row with the layout as a
block mask (flex.py: a response computes the prompt's keys and its own, not its segment's square),
compiled once per process; elsewhere, with dropout, or after FlexAttention failed once in the process
(one warning; `fallback_reason()`), the per-segment SDPA path above. `served()` counts the forward and
backward calls each kernel actually served (`reset_served()` starts over), so a check can tell the
kernel that ran from the one that was meant to.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from hilore_verl.shared_prompt.flex import flex_shared_attention
from hilore_verl.shared_prompt.layout import SharedLayout

logger = logging.getLogger(__name__)

ATTENTION_NAME = "hilore_shared_prompt"
LAYOUT_KWARG = "shared_prompt_layout"

_LAYOUT: contextvars.ContextVar[SharedLayout | None] = contextvars.ContextVar("hilore_shared_layout", default=None)


@contextlib.contextmanager
def shared_layout(layout: SharedLayout) -> Iterator[SharedLayout]:
    """Make `layout` the one the shared-prompt attention serves inside the block."""
    token = _LAYOUT.set(layout)
    try:
        yield layout
    finally:
        _LAYOUT.reset(token)


_FLEX_FAILED: list[str] = []  # why FlexAttention failed in this process (then the per-segment path serves)
# kernel -> {"forward": calls, "backward": calls} that kernel served since the last `reset_served()`
_SERVED: dict[str, dict[str, int]] = {}


def _record(kernel: str, out: torch.Tensor) -> torch.Tensor:
    """Count a forward served by `kernel`, and its backward once autograd has run it (a post-hook on the
    node that produced `out`: it fires after that node's gradient is computed)."""
    counts = _SERVED.setdefault(kernel, {"forward": 0, "backward": 0})
    counts["forward"] += 1
    if out.grad_fn is not None:
        def backward_ran(*_):
            counts["backward"] += 1
        out.grad_fn.register_hook(backward_ran)
    return out


def served() -> dict[str, dict[str, int]]:
    """Forward and backward calls each kernel served since `reset_served()`: what did run, not what should."""
    return {k: dict(v) for k, v in _SERVED.items()}


def reset_served() -> None:
    _SERVED.clear()


def fallback_reason() -> str | None:
    """Why FlexAttention failed in this process (the per-segment path has served since), or None."""
    return _FLEX_FAILED[0] if _FLEX_FAILED else None


def kernel_on(device: torch.device | str) -> str:
    """The kernel the shared-prompt attention runs on `device` (without dropout): "flex" on CUDA, unless
    it failed once in this process; "sdpa" (per segment) elsewhere."""
    return "flex" if torch.device(device).type == "cuda" and not _FLEX_FAILED else "sdpa"


def base_of(name: str | None) -> str:
    """The implementation an installed name delegates to ("sdpa" for None, as transformers defaults)."""
    name = name or "sdpa"
    prefix = ATTENTION_NAME + "+"
    return name[len(prefix) :] if name.startswith(prefix) else name


def register(base: str = "sdpa") -> str:
    """Register the shared-prompt attention over `base` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"{ATTENTION_NAME}+{base}"
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _attention_over(base))
        AttentionMaskInterface.register(name, _mask_over(base))
    return name


def install(model: torch.nn.Module) -> str:
    """Switch `model` to the shared-prompt attention over its current one; returns the previous name."""
    config = model.config
    previous = config._attn_implementation
    # set the config attribute every attention layer reads at each forward (set_attn_implementation
    # re-validates and reads the model's source file on each call)
    config._attn_implementation = register(base_of(previous))
    return previous


def uninstall(model: torch.nn.Module, previous: str | None = None) -> None:
    """Switch `model` back to `previous` (default: the base it was installed over)."""
    config = model.config
    config._attn_implementation = previous if previous is not None else base_of(config._attn_implementation)


@contextlib.contextmanager
def shared_attention(model: torch.nn.Module) -> Iterator[None]:
    """`install(model)` for the duration of the block; restored on exit, also when the forward raises."""
    previous = install(model)
    try:
        yield
    finally:
        uninstall(model, previous)


def _base_attention(base: str, module: torch.nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base != "eager" and base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    # eager lives in each model's own modeling file
    return sys.modules[type(module).__module__].eager_attention_forward


def _mask_over(base: str) -> Callable:
    def mask(*args, **kwargs):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if _LAYOUT.get() is not None or base not in ALL_MASK_ATTENTION_FUNCTIONS:
            return None  # the layout is the mask / a custom base builds none either
        return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)

    return mask


def _attention_over(base: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        layout = kwargs.pop(LAYOUT_KWARG, None)
        if layout is None:
            layout = _LAYOUT.get()
        if layout is None:
            return _base_attention(base, module)(module, query, key, value, attention_mask, **kwargs)
        if base == "sdpa":  # transformers' sdpa attention ignores a soft-cap: so does the same model shared
            kwargs.pop("softcap", None)
        return shared_prompt_attention(module, query, key, value, layout, **kwargs)

    return attention


def _check(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict, layout: SharedLayout) -> None:
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("shared-prompt attention: attention sinks (s_aux, e.g. GPT-OSS) are not supported")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("shared-prompt attention: only causal attention is supported")
    if kwargs.get("past_key_values") is not None:
        raise NotImplementedError("shared-prompt attention: a KV cache is not supported")
    if kwargs.get("sliding_window") is None and getattr(module, "sliding_window", None) is not None:
        raise NotImplementedError("shared-prompt attention: the layer has a sliding window its attention call does "
                                  "not pass (the model applies it through its mask only)")
    if query.shape[0] != 1 or query.shape[2] != layout.shared_tokens or key.shape[2] != layout.shared_tokens:
        raise NotImplementedError(
            f"shared-prompt attention: query {tuple(query.shape)} / key {tuple(key.shape)} are not one row "
            f"of the layout's {layout.shared_tokens} tokens"
        )


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # [B, H_kv, S, D] -> [B, H_kv * n_rep, S, D], each kv head repeated for its n_rep query heads
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _softcapped(q, k, v, mask, scaling: float, softcap: float, dropout: float) -> torch.Tensor:
    # q, k [1, H, L_g, D], v [1, H, L_g, Dv], mask [L_g, L_g] bool -> [1, H, L_g, Dv]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0.0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


def shared_prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, L, D]
    key: torch.Tensor,  # [1, H_kv, L, D]
    value: torch.Tensor,  # [1, H_kv, L, Dv]
    layout: SharedLayout,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of one packed row laid out as `layout`; any mask the model built is not needed.

    Returns (attn_output [1, L, H, Dv], None), the layout `sdpa_attention_forward` returns.
    """
    _check(module, query, key, {**kwargs, "sliding_window": sliding_window}, layout)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window is not None else None
    if dropout == 0.0 and kernel_on(query.device) == "flex":
        try:
            out = flex_shared_attention(query, key, value, layout, scaling, window, softcap)  # [1, H, L, Dv]
            return _record("flex", out).transpose(1, 2).contiguous(), None
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - said once; the per-segment path computes the same
            _FLEX_FAILED.append(f"{type(err).__name__}: {err}".splitlines()[0][:300])
            logger.warning("hilore-verl: FlexAttention failed (%s); the shared-prompt attention runs per segment "
                           "(SDPA over each segment's square) from now on", _FLEX_FAILED[0])
    n_rep = query.shape[1] // key.shape[1]
    if softcap is not None:  # the explicit path repeats k / v heads; SDPA reads them grouped (enable_gqa)
        key = _repeat_heads(key, n_rep)  # [1, H, L, D]
        value = _repeat_heads(value, n_rep)  # [1, H, L, Dv]

    outputs = []
    for index, group in enumerate(layout.groups):
        s, e = group.start, group.end
        mask = layout.segment_mask(index, window, query.device)  # [L_g, L_g]
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        if softcap is not None:
            out = _softcapped(q, k, v, mask, scaling, float(softcap), dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=n_rep > 1)
        outputs.append(_record("sdpa", out))  # [1, H, L_g, Dv]
    attn_output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]  # [1, H, L, Dv]
    return attn_output.transpose(1, 2).contiguous(), None
