"""What a pass allocates at once beyond what its forward holds (its transient), measured at the probe
and fitted for CostTable (planner/costs.py): probe 6 of planner/profiling.py.

Probe 1 (GC's plan) runs once more with its allocations followed (measure/allocations.py), with a mark
at each call of a decoder layer's unit (re-runs included), at the start of the head's call
(`Runtime.call`: the log-prob code over the vocabulary) and where the backward has made its inputs'
gradients. The marks split each phase in parts that grow apart:

    forward    the layers, final norm and lm_head           body: grows with the layers' tokens
               the head's call and the loss after it        tail: the level the body left (lm_head's
                                                            logits) with the tokens, the call's own
                                                            ops above it with the head's rows
    backward   the head's call's backward                   lead: with its rows
               lm_head's and the layers' backward           body: with the tokens

A part's transient is its most bytes alive at once less what the forward held. With the small probe,
the share of it that does not grow (autocast's weight copies, gathered parameters) is fitted against
the table's own growth to the small probe, so the table reproduces the small probe exactly:

    f_small / f_probe = a + (1 - a) g      g: the table's growth to the small probe (growth.fixed_share)

The head's parts are fitted per op (each top-level profiler event, the same ops at both probes): their
most is the larger of a few ops whose figures grow apart (at a small probe the weight gradient's fixed
copy, at a large micro-batch the logits' gradient), so one fit of the most would read the small
probe's fixed op as a fixed share of the large one's. The table keeps two ops: the highest at the
probe and the one that grows most. Where the head computes fewer rows than the layers' tokens (the
bench's response rows) or more (shared prompts laid back out), lm_head's logits follow the tokens
and the call's ops the rows: the tail's level at the call's start is a part of its own
(`head_forward_base_bytes`). The call's backward ends in its inputs' gradient (lm_head's logits,
tokens-sized), which the lead prices with the rows: an upper bound where the rows grow faster.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

from hilore_verl.measure.allocations import Allocations, allocations
from hilore_verl.planner.costs import CostTable, Tokens
from hilore_verl.planner.growth import fixed_share

logger = logging.getLogger("hilore_verl")

LAYER_MARK = "hilore_verl.layer_call"
CALL_MARKS = ("hilore_verl.head_call", "hilore_verl.head_inputs_grad")  # (forward: start, backward: end)


def _mark(name: str):
    with torch.profiler.record_function(name):
        pass


@contextlib.contextmanager
def pass_marks(runtime):
    """While the context is open, profiler marks (zero-length record_function ranges): LAYER_MARK at the
    start and the end of each call of a decoder layer's unit, re-runs included; CALL_MARKS[0] at the start
    of each `runtime.call` with gradients on (the head's log-prob code), CALL_MARKS[1] once the backward
    has made the gradients of that call's tensor inputs."""
    modules = {id(m): m for u in runtime.units if u.layer_index is not None for m in u.modules}
    handles = [m.register_forward_pre_hook(lambda *_: _mark(LAYER_MARK)) for m in modules.values()]
    handles += [m.register_forward_hook(lambda *_: _mark(LAYER_MARK)) for m in modules.values()]
    call = runtime.call

    def marked(unit_name, fn, *args, **kwargs):
        if torch.is_grad_enabled():
            _mark(CALL_MARKS[0])
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(inputs, lambda _: _mark(CALL_MARKS[1]))
        return call(unit_name, fn, *args, **kwargs)

    runtime.call = marked  # the instance's, over the class's method
    try:
        yield
    finally:
        del runtime.call
        for h in handles:
            h.remove()


def followed(runtime, plan: dict, run: Callable[[], None], device: torch.device) -> Allocations | None:
    """`run` under `plan` with its allocations followed and the layers marked; None, said once, where the
    allocator reports nothing. The plan in force is the caller's to restore."""
    runtime.set_plan(plan)
    try:
        with pass_marks(runtime):
            return allocations(run, device, marker=LAYER_MARK, call_marks=CALL_MARKS)
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
    above, small_above = _call_base(table, large, held, small if both else None, small_held, g)
    for name, ops, small_ops, over, small_over in (
            ("head_transient", large.backward_lead, small and small.backward_lead, held, small_held),
            ("head_forward_transient", large.forward_tail, small and small.forward_tail, above, small_above)):
        top, steep = _head_ops(ops, over, small_ops if both else None, small_over, g_head)
        for part, (value, fixed) in (("", top), ("_steep", steep)):
            setattr(table, f"{name}{part}_bytes", value)
            setattr(table, f"{name}{part}_fixed", fixed)


def _call_base(table: CostTable, large: Allocations, held: float, small: Allocations | None, small_held: float,
               g: float | None) -> tuple[float, float]:
    """With the head's call marked: sets the forward tail's level at the call's start (less what the
    forward holds outside the call: lm_head's logits, growing with the tokens) as the table's
    head_forward_base_*, and returns what the tail's ops are then measured above, at the probe and at
    the small probe (the call's start's level and what the call left held: its ops' own figures grow
    with the rows). Unmarked: no base, and the ops above what the forward held."""
    table.head_forward_base_bytes = table.head_forward_base_fixed = 0.0
    if not large.call_marked or (small is not None and not small.call_marked):
        return held, small_held
    value = max(large.call_base - (held - large.call_held), 0.0)
    table.head_forward_base_bytes = value
    if small is not None and g is not None:
        small_value = max(small.call_base - (small_held - small.call_held), 0.0)
        table.head_forward_base_fixed = fixed_share(small_value, value, g)
    small_above = small.call_base + small.call_held if small is not None else small_held
    return large.call_base + large.call_held, small_above


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


__all__ = ["CALL_MARKS", "LAYER_MARK", "fit", "followed", "pass_marks"]
