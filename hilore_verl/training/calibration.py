"""What the first mini-batch measures before it trains: the cost table and the risk model; and the
gradient audit's extra passes on later ones (`audit`).

`measure` profiles the cost table on a probe of this rank's micro-batches (whole sequences, at most
`hilore.profile_tokens` tokens; a half probe beside it prices growth with the tokens) and calibrates
the risk model on the most exposed sequences that fit the same bound, then averages both over the
data-parallel ranks so every rank plans from the same numbers. `Session.build_controller` calls it
once per run (a resumed run takes both from its checkpoint instead). Free of verl and of
torch.distributed: the framework's passes and collectives are the session's (session.py).
"""

from __future__ import annotations

import logging
import math

import torch

from hilore_verl.training.config import HiLoReConfig
from hilore_verl.planner import profile
from hilore_verl.planner.costs import CostTable, measured_values, set_measured_values
from hilore_verl.training.probe import half_probe, probe_indices, probe_token_bound, profile_indices
from hilore_verl.loss.risk import RiskModel, calibrate_by_group
from hilore_verl.runtime import RECOMPUTE, Runtime, UnitPlan

logger = logging.getLogger("hilore_verl")

HALF_PROBE_AT_MOST = 0.6  # of the probe's computed tokens, for the profile's second probe


def measure(config: HiLoReConfig, runtime: Runtime, passes, collectives,
            micro_batches: list) -> tuple[CostTable, RiskModel | None, int]:
    """The cost table, (with a risk budget and known coefficients) the risk model, measured on probes of
    `micro_batches` (this rank's) and averaged over ranks, and `calibrate_risk`'s token figure (0 without
    a risk model); the runtime's plan is reset. The risk model comes back uncalibrated
    (`RiskModel.calibrated` false) when its probes measured nothing: the session then calibrates it
    again later (`calibrate_risk`)."""
    bound = probe_token_bound(config.profile_tokens, sum(sum(passes.lengths(mb)) for mb in micro_batches))
    costs = _profile(config, runtime, passes, collectives, probe(passes, micro_batches[0], bound, profile=True))
    average_over_ranks(collectives, costs, None)
    risk, tokens = None, 0
    if config.risk_budget > 0 and passes.has_coefficients:
        risk = RiskModel()
        tokens = calibrate_risk(config, runtime, passes, collectives, micro_batches, risk)
    passes.zero_grad()
    runtime.set_plan({})
    return costs, risk, tokens


def calibrate_risk(config: HiLoReConfig, runtime: Runtime, passes, collectives, micro_batches: list,
                   model: RiskModel, at_least: int = 0) -> int:
    """Calibrate `model` in place on `micro_batches` (this rank's), averaged over ranks. Returns the probes'
    token bound summed over the ranks (every rank the same figure) where the probes ran, else 0; after
    they ran, `model.calibrated` says whether they measured something (a probe whose saved tensors are
    all below the runtime's `min_bytes` compresses nothing and measures no deviation).

    No probe runs, `model` is unchanged and 0 comes back where no rank's micro-batches have a loss term
    (every coefficient zero: groups that share one reward, the first steps of many GRPO runs) or where
    the ranks' bound is below `at_least` (the session's floor after probes that measured nothing). Every
    rank decides alike (one reduction) and runs the same probe passes, whose FSDP collectives pair; a
    rank whose own micro-batches have no exposure measures nothing and takes the others' figures. `model`
    changes only when every probe has run."""
    bound = probe_token_bound(config.profile_tokens, sum(sum(passes.lengths(mb)) for mb in micro_batches))
    squares = torch.stack([passes.coefficients(mb).double().pow(2).sum() for mb in micro_batches]).tolist()  # one read
    exposure, tokens = collectives.reduce([sum(squares), float(bound)], "sum")
    if exposure <= 0 or tokens < at_least:
        return 0
    measured = _calibrate(config, runtime, passes, micro_batches, bound)
    _average_risk(collectives, [u.name for u in runtime.units], measured)
    passes.zero_grad()
    runtime.set_plan({})
    model.load_state_dict(measured.state_dict())
    return max(int(tokens), 1)


def probe(passes, micro_batch, bound: int, priority=None, profile: bool = False):
    """Whole sequences of `micro_batch` up to `bound` tokens (training/probe.py); `profile`: the cost
    profile's probe, two sequences where one alone would leave no half probe (`profile_indices`)."""
    lengths = passes.lengths(micro_batch)
    index = profile_indices(lengths, bound) if profile else probe_indices(lengths, bound, priority)
    return micro_batch if len(index) == len(lengths) else passes.select(micro_batch, index)


def surrogate(runtime: Runtime, passes, plan: dict[str, UnitPlan], batch, c: torch.Tensor):
    """This rank's gradient of sum_t c_t log p_t under `plan`; units it does not name are
    recomputed (exact, and the least memory)."""
    full = {u.name: RECOMPUTE for u in runtime.units}
    full.update(plan)
    return passes.surrogate_gradient(full, batch, c)


def audit(runtime: Runtime, passes, collectives, controller, step: int, micro_batches: list):
    """Exact vs planned gradient of one micro-batch with exposure (2 extra forward + backward passes), fed
    to the controller's audit (`Controller.record_audit`); its AuditResult, or None.

    The surrogate sum_t c_t log p_t measures the c part of the update, so the micro-batch is chosen
    by the L2 of c (reduced over ranks: every rank audits the same index) and its prediction uses
    that exposure, without the entropy bound planning adds. No micro-batch with exposure, or a
    zero exact gradient: None, and nothing is recorded or changed."""
    coefficients = [passes.coefficients(mb) for mb in micro_batches]
    squares = collectives.reduce(torch.stack([c.double().pow(2).sum() for c in coefficients]).tolist(), "sum")
    exposure_l2 = [math.sqrt(s) for s in squares]
    index = controller.audit_micro_batch(step, exposure_l2)
    if index is None:
        return None
    batch, c = micro_batches[index], coefficients[index]
    plan = controller.plan_micro_batch(index)
    approx = surrogate(runtime, passes, controller.runtime_plan(plan), batch, c)
    exact = surrogate(runtime, passes, {}, batch, c)
    passes.zero_grad()
    return controller.record_audit(step, exact, approx, exposure_l2[index],
                                   reduce=None if collectives.world_size == 1 else collectives.sum_)


def _profile(config: HiLoReConfig, runtime: Runtime, passes, collectives, batch) -> CostTable:
    """The cost table from training passes on `batch` and, where it pays, on half its sequences."""
    lengths = passes.lengths(batch)
    half = half_probe(lengths, list(range(len(lengths))))
    small = passes.select(batch, half) if half is not None else None
    # the half probe must compute about half the probe's tokens: sequences sharing one prompt
    # (hilore.shared_prompt) halve the row but not the prompt, and a second probe barely smaller
    # than the first would read noise as growth faster than linear (then every figure scales linearly)
    if small is not None and passes.layer_tokens(small) > HALF_PROBE_AT_MOST * passes.layer_tokens(batch):
        small = None
    # ranks run the same probe passes (FSDP collectives): the half probe only where every rank has one
    if not collectives.reduce([float(small is not None)], "min")[0]:
        small = None
        logger.info("hilore-verl: the profile has no half-size second probe (%s): its figures, fixed parts "
                    "such as weight copies included, scale linearly with the tokens",
                    "one sequence" if half is None else "not half the probe's tokens, or not on every rank")

    def run(b):
        return lambda: passes.train_pass(b)

    # growth with tokens squared only where attention spans the packed row (a dense mask): attended per
    # sequence, or with sequences sharing prompts, the two probes' different sequences would read as
    # such growth (the sequences' squares and the head's share of response tokens change with the
    # sequences, not with the tokens); every rank the same way
    dense = passes.row_attention and passes.layer_tokens(batch) == sum(lengths)
    quadratic = collectives.reduce([float(dense)], "min")[0] > 0
    heads = (passes.head_rows(batch), passes.head_rows(small) if small is not None else None)
    return profile(runtime, run(batch), passes.layer_tokens(batch), element_size=passes.element_size,
                   formats=config.formats, offload=config.offload, group_size=config.group_size,
                   quadratic=quadratic, small=None if small is None else (run(small), passes.layer_tokens(small)),
                   head_rows=None if heads[0] is None else heads)


def _calibrate(config: HiLoReConfig, runtime: Runtime, passes, micro_batches: list, bound: int) -> RiskModel:
    """Sensitivities per calibration group, on the local micro-batch with the most exposure (its most
    exposed sequences that fit `bound`)."""
    exposures = [passes.coefficients(mb) for mb in micro_batches]
    best = max(range(len(micro_batches)), key=lambda i: float(exposures[i].pow(2).sum()))
    batch = probe(passes, micro_batches[best], bound, priority=exposures[best].pow(2).sum(-1).tolist())
    coeff = passes.coefficients(batch)
    return calibrate_by_group(lambda plan: surrogate(runtime, passes, plan, batch, coeff),
                              [u.name for u in runtime.units], float(coeff.pow(2).sum().sqrt()),
                              fmts=config.formats[:1], group_size=config.group_size, model=RiskModel(),
                              groups={u.name: u.group for u in runtime.units})


def average_over_ranks(collectives, costs: CostTable, risk: RiskModel | None = None) -> None:
    """Every rank must plan from the same numbers: average the measured ones (a fixed-length vector on
    every rank), the cost table's and, given one, the risk model's."""
    if risk is not None:
        _average_risk(collectives, [u.name for u in costs.units], risk)
    if collectives.world_size == 1:
        return
    figures = measured_values(costs)
    world = collectives.world_size
    it = iter(collectives.reduce(figures + [float(costs.tokens), float(costs.head_rows)], "sum"))
    set_measured_values(costs, [next(it) / world for _ in figures])
    costs.tokens = int(round(next(it) / world))
    costs.head_rows = int(round(next(it) / world))  # the probes' head rows (0 on every rank: none said)


def _average_risk(collectives, names: list[str], risk: RiskModel) -> None:
    """Sensitivities as the geometric mean over the ranks that measured each unit (a rank whose probe had
    no exposure measured none), the gradient scale over the ranks that measured one."""
    if collectives.world_size == 1:
        return
    values = []
    for n in names:  # (sum of log sensitivity, how many ranks measured it)
        measured = n in risk.sensitivity
        values += [math.log(risk.sensitivity[n]) if measured else 0.0, float(measured)]
    values += [risk.grad_scale or 0.0, float(bool(risk.grad_scale))]
    it = iter(collectives.reduce(values, "sum"))
    risk.sensitivity.clear()
    for n in names:
        total, count = next(it), next(it)
        if count:
            risk.sensitivity[n] = math.exp(total / count)
    total, count = next(it), next(it)
    risk.grad_scale = total / count if count else None
