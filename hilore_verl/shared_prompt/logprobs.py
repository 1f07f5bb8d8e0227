"""Response log-probs of a micro-batch with each group's prompt computed once, and the ordinary reference.

    seqs = [(group_id, prompt_ids, response_ids), ...]              # 1-D LongTensors
    logp = shared_log_probs(model, seqs)                            # one [R_i] tensor per sequence
    logp, ent = shared_log_probs(model, seqs, with_entropy=True)
    ref = unshared_log_probs(model, seqs)                           # one forward per sequence

`shared_log_probs` runs one forward of the whole micro-batch in the shared layout (layout.py) on the
shared-prompt attention (attention.py) and returns, in the input order, what the ordinary forward of
each sequence returns: log p(response token | everything before it) at `temperature`, and optionally
the entropy of each predicting distribution. The lm head runs only on the predicting positions
(`logits_to_keep`, where the model takes it). Models whose attention the shared path cannot serve
(e.g. GPT-OSS's attention sinks) get one warning per call and the ordinary forward, never a different
result. Every prompt needs at least one token (see layout.py).

Activation checkpointing: when the forward will be recomputed in the backward (the model is in
training mode with gradient checkpointing on and autograd recording), the model stays installed on
the shared-prompt attention after the call, so that the recompute serves the same layout; installed,
the model still computes ordinary inputs exactly as before (attention.py). `uninstall(model)` undoes it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import torch

from hilore_verl.shared_prompt.attention import LAYOUT_KWARG, install, shared_layout, uninstall
from hilore_verl.shared_prompt.layout import SequenceSpec, SharedLayout

logger = logging.getLogger(__name__)

Result = list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _recomputes(model: torch.nn.Module) -> bool:
    """Whether a backward through this forward will run the layers again (activation checkpointing)."""
    if not (torch.is_grad_enabled() and model.training):
        return False
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _score(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    # logits [T, V], targets [T] -> log-probs [T] (and entropies [T])
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [T, V]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [T]
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [T]
    return logp, entropy


def shared_logits(model: torch.nn.Module, layout: SharedLayout) -> torch.Tensor:
    """[T, V]: the logits predicting each response token of `layout`, from one shared forward.

    Raises NotImplementedError where the shared-prompt attention cannot serve the model.
    """
    previous = install(model)
    keep_installed = _recomputes(model)
    kwargs = {}
    if _takes_logits_to_keep(model):
        # the lm head only on the predicting positions; the prompt's last one serves all its responses
        keep, where = torch.unique(layout.predict_index, sorted=True, return_inverse=True)  # [K], [T]
        kwargs["logits_to_keep"] = keep
    try:
        with shared_layout(layout):
            out = model(
                input_ids=layout.input_ids,  # [1, L]
                position_ids=layout.position_ids,  # [1, L]
                use_cache=False,
                **{LAYOUT_KWARG: layout},
                **kwargs,
            )
    except BaseException:
        uninstall(model, previous)
        raise
    if not keep_installed:
        uninstall(model, previous)
    logits = out.logits[0]  # [K, V] or [L, V]
    return logits[where] if kwargs else logits[layout.predict_index]  # [T, V]


def shared_log_probs(
    model: torch.nn.Module,
    sequences: Sequence[SequenceSpec],
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Result:
    """Per input sequence its response tokens' log-probs [R_i] (and entropies [R_i] if asked)."""
    layout = SharedLayout.build(sequences, device=_device(model))
    try:
        logits = shared_logits(model, layout)  # [T, V]
    except NotImplementedError as exc:
        logger.warning(
            "shared-prompt forward not available for %s (%s); computing each sequence unshared",
            type(model).__name__,
            exc,
        )
        return unshared_log_probs(model, sequences, temperature=temperature, with_entropy=with_entropy)
    logp, entropy = _score(logits, layout.target_ids, temperature, with_entropy)
    if with_entropy:
        return layout.split(logp), layout.split(entropy)
    return layout.split(logp)


def unshared_log_probs(
    model: torch.nn.Module,
    sequences: Sequence[SequenceSpec],
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Result:
    """The reference: one ordinary forward of prompt + response per sequence, same outputs as above."""
    device = _device(model)
    logps, entropies = [], []
    for i, (_, prompt, response) in enumerate(sequences):
        prompt = torch.as_tensor(prompt).reshape(-1).long().to(device)
        response = torch.as_tensor(response).reshape(-1).long().to(device)
        p, r = prompt.numel(), response.numel()
        if p == 0:
            raise ValueError(f"sequence {i} has an empty prompt: its first response token has no predicting position")
        ids = torch.cat([prompt, response])[None]  # [1, P + R]
        logits = model(input_ids=ids, use_cache=False).logits[0, p - 1 : p + r - 1]  # [R, V]
        logp, entropy = _score(logits, response, temperature, with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    return (logps, entropies) if with_entropy else logps
