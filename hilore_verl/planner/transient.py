"""What a pass allocates at once beyond what its forward holds (its transient), measured at the probe
and fitted for CostTable (planner/costs.py): probe 6 of planner/profiling.py.

Probe 1 (GC's plan) runs once more with its allocations followed (peak_memory.allocations) and with a
mark at each call of a decoder layer's unit, re-runs included, which splits each phase in two parts
that grow apart:

    forward    up to the last layer's mark      the layers' working memory: grows with their tokens
               after it                         the head's logits and log-softmax: with its rows
    backward   before the first layer's mark    the head's backward (the logits' gradient): its rows
               from it on                       a layer's re-run and backward: the layers' tokens

A part's transient is its most bytes alive at once less what the forward held. With the small probe,
the share of it that does not grow (autocast's weight copies, gathered parameters) is fitted against
the table's own growth to the small probe, so the table reproduces the small probe exactly:

    f_small / f_probe = a + (1 - a) g      g: the table's growth to the small probe (growth.fixed_share)

The head's parts are fitted per op (each top-level profiler event, the same ops at both probes): their
most is the larger of a few ops whose figures grow apart (at a small probe the weight gradient's fixed
copy, at a large micro-batch the logits' gradient), so one fit of the most would read the small
probe's fixed op as a fixed share of the large one's. The table keeps two ops: the highest at the
probe and the one that grows most.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from hilore_verl.measure.peak_memory import Allocations, allocations
from hilore_verl.planner.costs import CostTable, Tokens
from hilore_verl.planner.growth import fixed_share

logger = logging.getLogger("hilore_verl")

LAYER_MARK = "hilore_verl.layer_call"


@contextlib.contextmanager
def layer_marks(runtime):
    """A profiler mark (record_function LAYER_MARK) at the start and the end of each call of a decoder
    layer's unit, re-runs included, while the context is open."""
    def mark(*_):
        with torch.profiler.record_function(LAYER_MARK):
            pass

    modules = {id(m): m for u in runtime.units if u.layer_index is not None for m in u.modules}
    handles = [m.register_forward_pre_hook(mark) for m in modules.values()]
    handles += [m.register_forward_hook(mark) for m in modules.values()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def followed(runtime, plan: dict, run: Callable[[], None], device: torch.device) -> Allocations | None:
    """`run` under `plan` with its allocations followed and the layers marked; None, said once, where the
    allocator reports nothing. The plan in force is the caller's to restore."""
    runtime.set_plan(plan)
    try:
        with layer_marks(runtime):
            return allocations(run, device, marker=LAYER_MARK)
    except RuntimeError as err:
        logger.warning("hilore-verl: the backward's working memory is not measured (%s); the memory model "
                       "reserves the largest unit's saved bytes for it", err)
        return None


def fit(table: CostTable, large: Allocations | None, held: float, small: Allocations | None = None,
        small_held: float = 0.0, small_tokens: Tokens | None = None) -> None:
    """Set `table`'s transients from the probe's followed pass `large` (its forward held `held`) and, with
    the small probe's (`small`, `small_held`, `small_tokens`), their fixed shares. Gradients outlive the
    pass and are not counted (the static bytes hold them); the share of them allocated by the backward's
    peak (the probe starts without gradients) is `gradients_at_peak`. Nothing followed: the table keeps
    its zeros and reserves its largest unit."""
    if large is None:
        return
    table.gradients_at_peak = large.backward_kept / large.kept if large.kept > 0 else 1.0
    both = small is not None and small_tokens is not None
    g, g_head = (table.growth(small_tokens), table.head_growth(small_tokens)) if both else (None, None)
    for name, figure, small_figure in (("transient", large.backward_body_during, small and small.backward_body_during),
                                       ("forward_transient", large.forward_body_during,
                                        small and small.forward_body_during)):
        value = max(figure - held, 0.0)
        fixed = fixed_share(max(small_figure - small_held, 0.0), value, g) if both else 0.0
        setattr(table, f"{name}_bytes", value)
        setattr(table, f"{name}_fixed", fixed)
    for name, ops, small_ops in (("head_transient", large.backward_lead, small and small.backward_lead),
                                 ("head_forward_transient", large.forward_tail, small and small.forward_tail)):
        top, steep = _head_ops(ops, held, small_ops if both else None, small_held, g_head)
        for part, (value, fixed) in (("", top), ("_steep", steep)):
            setattr(table, f"{name}{part}_bytes", value)
            setattr(table, f"{name}{part}_fixed", fixed)


def _head_ops(ops, held: float, small_ops, small_held: float, g: float | None
              ) -> tuple[tuple[float, float], tuple[float, float]]:
    """(bytes, fixed share) of the op highest at the probe and of the op that grows most, from `ops`
    ((name, during) per op) less `held`, fitted against `small_ops` where those are the same ops; else
    the part's most as one figure (fitted against the small probe's most where there is one)."""
    values = [max(v - held, 0.0) for _, v in ops]
    if not values:
        return (0.0, 0.0), (0.0, 0.0)
    if small_ops is None or [n for n, _ in small_ops] != [n for n, _ in ops]:
        whole = max(values)
        fixed = fixed_share(max(max((v for _, v in small_ops), default=0.0) - small_held, 0.0), whole, g) \
            if small_ops and g is not None else 0.0
        return (whole, fixed), (whole, fixed)
    fits = [(v, fixed_share(max(s - small_held, 0.0), v, g)) for v, (_, s) in zip(values, small_ops)]
    top = max(fits, key=lambda f: f[0])
    steep = max(fits, key=lambda f: (f[0] * (1 - f[1]), f[0]))
    return top, steep


__all__ = ["LAYER_MARK", "fit", "followed", "layer_marks"]
