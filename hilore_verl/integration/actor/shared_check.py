"""The shared prompt's first-use self-check: the first micro-batch it would share is also computed per
sequence, and sharing stays on for the run only if the two agree.

    if shared.check_due:                          # engine.forward_step, before the micro-batch's own pass
        self_check(shared, micro_batch, forward, collectives)

Every data-parallel rank takes part at the same micro-batch (the extra forwards gather FSDP's
parameters): the ranks agree whether any of them would share this micro-batch, each computes its own
micro-batch's log-probs both ways without gradients, and sharing goes off on every rank when any rank's
log-probs differ beyond BOUNDS or its shared forward raised, with one warning that says why. Its cost:
two forwards of one micro-batch without gradients, once per run (and one reduction of one number per
micro-batch until a micro-batch is shareable).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# compute dtype -> (max |difference|, mean |difference|) of the log-probs, shared against per sequence:
# the two layouts reduce attention's sums in another order; fp32 agrees to ~1e-6, bf16 to its rounding
BOUNDS = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (0.5, 0.02), torch.float16: (0.1, 0.005)}


def compare(plain: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the shared forward's log-probs agree with the per-sequence ones within BOUNDS[dtype]."""
    if plain.shape != shared.shape:
        return False, f"log-probs of {tuple(shared.shape)} against {tuple(plain.shape)} per sequence"
    worst, mean = BOUNDS.get(dtype, BOUNDS[torch.bfloat16])
    a, b = plain.double(), shared.double()
    diff = torch.where(a == b, 0.0, (a - b).abs())  # equal infinities agree
    if not bool(torch.isfinite(shared).all()) and bool(torch.isfinite(plain).all()):
        return False, "the shared forward's log-probs are not finite"
    top, avg = (float(diff.max()), float(diff.mean())) if diff.numel() else (0.0, 0.0)
    said = f"max |diff| {top:.2e} (bound {worst:g}), mean {avg:.2e} (bound {mean:g}) over {diff.numel()} tokens"
    return top <= worst and avg <= mean, said


def self_check(shared, micro_batch, forward: Callable[[bool], torch.Tensor], dtype: torch.dtype,
               collectives) -> None:
    """Run the check if any rank would share `micro_batch` (see the module docstring); `forward(on)` returns
    the micro-batch's log-probs [tokens] with sharing on or off."""
    due = collectives.reduce([1.0 if shared.would_share(micro_batch) else 0.0], "max")[0] > 0
    if not due:
        return
    start = time.perf_counter()
    ok, why = True, ""
    with torch.no_grad():
        plain = forward(False)
        try:
            ok, why = compare(plain, forward(True), dtype)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - the reason is reported; the ordinary layout serves
            ok, why = False, f"the shared forward raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    agreed = collectives.reduce([1.0 if ok else 0.0], "min")[0] > 0
    seconds = time.perf_counter() - start
    if agreed:
        shared.checked(True, f"agreed with the per-sequence forward: {why}", seconds)
        logger.warning("hilore-verl: shared prompt on: its first-use self-check passed in %.2f s (%s)", seconds, why)
        return
    reason = why if not ok else "another rank's shared forward disagreed with its per-sequence forward"
    shared.checked(False, reason, seconds)
    logger.warning("hilore-verl: shared prompt off for this run: its first-use self-check failed (%s); every "
                   "micro-batch runs in verl's ordinary layout", reason)
