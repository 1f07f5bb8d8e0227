"""Per-mini-batch controller: statistics in, plan out, identical on every data-parallel rank.

    ctl = Controller(runtime, costs, risk, BudgetConfig(), static_bytes=..., risk_budget=0.01)
    ctl.begin_mini_batch(exposure_l2=[...], tokens=[...])   # per micro-batch, reduced over ranks
                                                          # (row_tokens=[...]: the shared-prompt layout's rows;
                                                          #  head_rows=[...]: the head's, where fewer)
    for i in micro-batches:  plan = ctl.plan_micro_batch(i)   # the caller applies it (session.py)
                             forward ; ctl.after_forward(i, exact_l2) ; backward
    ctl.metrics()                                         # reads the exact exposures, one transfer
    ctl.end_mini_batch(measured_peak_bytes)               # max over ranks; plans tighter / looser after it
    after an out-of-memory retry: ctl.on_oom()            # later plans 10% tighter
    checkpoints:             ctl.state_dict() (plain numbers and names; planner/state.py writes and checks the file)
    how a plan is found (solver under the memory model, then the arm's choice): planner/search.py

Memory model of the actor update's peak (what the planner must keep under the budget):

    peak = static + unmanaged + sum_u memory(u, option) + the larger of the forward's and the backward's
           transient (measured at the probe; the backward's less what the plan does not regenerate)

A micro-batch has two sizes where each group's prompt is computed once (hilore.shared_prompt): the
tokens its layers compute, T (the shared layout's row), and the tokens of the ordinary packed row,
N >= T. Every figure of the memory model follows T, as the probe measured them (its head and loss
state on its own N for its T: about the micro-batch's share); the gc_ratio budget follows N: it stays
a multiple of GC's peak without the layout, the memory the update had before the switch, so the
layout's saving can be spent on keeping more. Without the layout N = T.

Risk: micro-batch i's lossy units may spend sqrt(sum_u risk(u)^2) up to its allowance, the
mini-batch's risk_budget x grad_scale x exposure_l2(mini-batch) split evenly over micro-batches
(in quadrature). Exposures and token counts come reduced over the data-parallel group (session.py). A micro-batch with no exposure (all zero-advantage) spends nothing, whatever it
compresses; a high-exposure one must keep or recompute more.

The risk spent (`after_forward`, from the exact coefficients of the real log-probs) is a metric
only, read lazily (planner/spent.py): nothing between a micro-batch's forward and its backward waits
for the device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hilore_verl.planner.arms import ArmTrial
from hilore_verl.planner.step_time import StepTimeScale
from hilore_verl.planner.budget import BudgetConfig
from hilore_verl.planner.costs import CostTable, Tokens
from hilore_verl.planner.peak_feedback import PeakFeedback
from hilore_verl.planner.search import PlanSearch
from hilore_verl.planner.solver import Infeasible
from hilore_verl.planner.spent import Exact, SpentRisk
from hilore_verl.loss.risk import AuditResult, GradientAudit, RiskModel
from hilore_verl.runtime import KEEP, RECOMPUTE, Runtime, UnitPlan


HISTORY_KEPT = 4096  # plan records kept for metrics and tests; older ones are dropped


@dataclass
class PlanRecord:
    plan: dict[str, UnitPlan]
    predicted_peak: float
    predicted_risk: float
    risk_allowance: float
    solve_ms: float
    spent_risk: float | None = None


@dataclass
class Controller:
    runtime: Runtime
    costs: CostTable
    risk: RiskModel | None
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    static_bytes: float = 0.0
    gradient_bytes: float = 0.0  # the gradients' part of static_bytes (absent until a first backward)
    risk_budget: float = 0.01
    token_bucket: int = 256
    free_bytes: float | None = None
    oom_factor: float = 1.0  # x0.9 after each out-of-memory retry, never loosened (checkpointed)
    audit: GradientAudit | None = None  # run by the integration on its schedule; adjusts risk_budget
    stochastic: bool = False  # compressed units round stochastically (seeded by the runtime's RuntimeConfig.seed)
    measure_baseline: bool = True  # time the solver's plans against the hands-off baseline, run the faster
    history: list[PlanRecord] = field(default_factory=list)

    def __post_init__(self):
        self.gc_peak = self.predicted_peak(self.gc_plan(), self.costs.tokens)
        self.memory_budget = self.budget.resolve(self.gc_peak, self.free_bytes)
        # the least memory an exact plan needs: full recompute's, or GC's where its kept head holds less than
        # a recomputed head's inputs (the logits) do
        least = min(self.predicted_peak(p, self.costs.tokens) for p in (self.all_units(RECOMPUTE), self.gc_plan()))
        if self.memory_budget < least:
            raise ValueError(f"the memory budget {self.memory_budget / 2**30:.3f} GiB is below what full recompute "
                             f"(or GC, where less) needs: {least / 2**30:.3f} GiB at {self.costs.tokens} tokens per "
                             "micro-batch")
        self._cache: dict[tuple, tuple[dict[str, UnitPlan], bool]] = {}  # key -> (plan, whether the arm chose it)
        self._micro: list[tuple[float, Tokens, Tokens]] = []  # per micro-batch: (exposure, T, N) (module docstring)
        self._predicted_peaks: list[float] = []  # this mini-batch's plans' predicted peaks, for end_mini_batch
        self.peaks = PeakFeedback()  # the measured-peak feedback (planner/peak_feedback.py)
        self.spent = SpentRisk(lambda plan, l2: self.risk.predict(self.runtime_plan(plan), l2))  # planner/spent.py
        self._allowance2 = 0.0
        self._audit_result: AuditResult | None = None  # the audit of the current mini-batch, if one ran
        self.arms = ArmTrial()  # the solver's plans against the hands-off baseline, measured (planner/arms.py)
        self.step_time = StepTimeScale()  # measured / modelled mini-batch seconds (planner/step_time.py)
        self._size_s = 0.0  # this mini-batch's modelled seconds under GC's plan: the arms' size (planner/arms.py)
        self.search = PlanSearch(self)  # how a micro-batch's plan is found (planner/search.py)

    @property
    def memory_factor(self) -> float:
        """What the memory budget is multiplied by: out-of-memory retries and measured peaks, together."""
        return self.oom_factor * self.peaks.factor

    # ------------------------------------------------------------------ memory model
    def predicted_peak(self, plan: dict[str, UnitPlan], tokens: int, gradients: bool = True) -> float:
        """static + held + the larger phase's transient (forward, backward). `gradients` False: a
        micro-batch that starts without gradients (the first after zero_grad): its forward holds none,
        its backward's peak the share of them allocated by then (measured)."""
        held = self.static_bytes + self.held_bytes(plan, tokens)
        absent = 0.0 if gradients else self.gradient_bytes
        forward = held - absent + self.costs.forward_transient(tokens, plan)
        backward = held - absent * (1 - self.costs.gradients_at_peak) + self.costs.backward_transient(plan, tokens)
        return max(forward, backward)

    def gc_plan(self) -> dict[str, UnitPlan]:
        """The plan a gc_ratio budget is a multiple of: gradient checkpointing as the model had it before
        the runtime took over (verl's GC: each checkpointed layer recomputed, the head and anything
        outside the layers kept), or every unit recomputed where the model had no checkpointing (or no
        runtime is attached, as in what-if planning)."""
        checkpoint = self.runtime.checkpoint_plan() if self.runtime is not None else None
        return checkpoint if checkpoint is not None else self.all_units(RECOMPUTE)

    def gc_always_fits(self) -> dict[str, UnitPlan] | None:
        """The hands-off GC plan where it is within the budget by definition, whatever the measured peaks
        say: a gc_ratio budget (value >= 1) is a multiple of that very plan's peak, and budget and plans
        are predicted by one memory model, so a misprediction that tightens the measured-peak factor would
        otherwise rule out what the user runs without HiLoRe and leave plans slower than it. None after an
        out-of-memory retry (then GC may not fit either), under a fixed budget, or without the model's
        own checkpointing."""
        if self.budget.mode != "gc_ratio" or self.oom_factor < 1.0 or self.runtime is None:
            return None
        return self.runtime.checkpoint_plan()

    def memory_budget_at(self, tokens: int) -> float:
        """gc_ratio budgets follow GC's peak (`gc_plan`) at the micro-batch size; gib / auto are fixed."""
        if self.budget.mode == "gc_ratio":
            return self.budget.value * self.predicted_peak(self.gc_plan(), tokens)
        return self.memory_budget

    def limit(self, tokens: int) -> float:
        """The peak a plan for `tokens` may predict (the budget, tightened, plus rounding slack)."""
        return self.memory_budget_at(tokens) * self.memory_factor * (1 + 1e-9)

    def activation_budget(self, tokens: int, row: int | None = None) -> float:
        row = tokens if row is None else row
        free = (self.memory_budget_at(row) * self.memory_factor - self.static_bytes
                - self.costs.unmanaged(tokens)
                - max(self.costs.transient(tokens), self.costs.forward_transient(tokens)))
        return max(free, 0.0)  # a budget of exactly the GC peak can round a few ulps below zero

    # ------------------------------------------------------------------ per mini-batch
    def begin_mini_batch(self, exposure_l2: list[float], tokens: list[int],
                         row_tokens: list[int] | None = None, seconds: float | None = None,
                         head_rows: list[int | None] | None = None) -> None:
        """Per micro-batch: exposure (L2 of c) and tokens its layers compute, as figures global to the
        data-parallel group (the session reduces them: sum of squares, max), so that micro-batch i gets
        the same plan on every rank; `row_tokens`: its ordinary packed row's, where the shared-prompt
        layout computes fewer (default: `tokens`); `head_rows`: the rows its head's log-prob code computes
        where the host says (costs.Tokens; default: every token). `seconds`: the last mini-batch's measured
        time (the slowest rank's; None when not timed), for the measured choice of arm (planner/arms.py, over the
        modelled time of GC's plan on its micro-batches) and the measured step-time scale
        (planner/step_time.py)."""
        n = len(exposure_l2)
        row_tokens = list(tokens) if row_tokens is None else list(row_tokens)
        head_rows = [None] * n if head_rows is None else list(head_rows)
        if n != len(tokens) or n != len(row_tokens) or n != len(head_rows) or n == 0:
            raise ValueError(f"need one exposure and one token count per micro-batch; got {n}, {len(tokens)} "
                             f"and {len(row_tokens)} row counts")
        if any(r < t for r, t in zip(row_tokens, tokens)):
            raise ValueError(f"a micro-batch's packed row holds fewer tokens than its layers compute: "
                             f"{row_tokens} < {list(tokens)}")
        size, self._size_s = self._size_s, 0.0
        self.arms.record(seconds / size if seconds is not None and size > 0 else None)
        self.step_time.measured(seconds)
        self.record_spent()  # the last mini-batch's, under the risk model it planned with
        grad_scale = self.risk.grad_scale if self.risk is not None and self.risk.grad_scale else 0.0
        self._allowance2 = (self.risk_budget * grad_scale) ** 2 * sum(e * e for e in exposure_l2) / n
        self._micro = [(float(e), Tokens(t, h), Tokens(r, h))
                       for e, t, r, h in zip(exposure_l2, tokens, row_tokens, head_rows)]
        self._predicted_peaks = []
        self._audit_result = None

    def exposure(self, index: int) -> float:
        """Micro-batch `index`'s exposure (L2 of c, reduced over ranks), as planned."""
        return self._micro[index][0]

    def tokens(self, index: int) -> tuple[int, int]:
        """Micro-batch `index`'s (tokens its layers compute, tokens of its packed row), as planned."""
        return self._micro[index][1], self._micro[index][2]

    def plan_micro_batch(self, index: int, gradients: bool = True) -> dict[str, UnitPlan]:
        """Solve (or reuse) the plan for one local micro-batch; the caller applies it (`runtime_plan`).
        `gradients` False: it starts without gradients (the first after zero_grad); its plan fits as
        if they were there (every micro-batch's plan does), its predicted peak is what it will hold."""
        l2, tokens, row = self._micro[index]  # global figures: the same on every rank
        bucket = math.ceil(tokens / self.token_bucket) * self.token_bucket
        head = None if tokens.head is None else math.ceil(tokens.head * bucket / tokens)  # at the same share
        bucket, bucket_row = Tokens(bucket, head), Tokens(math.ceil(row * bucket / tokens), head)  # ... of its row
        allowance = math.sqrt(self._allowance2)
        share = None if head is None else round(head / bucket, 2)
        key = (bucket, round(tokens / row, 2), share, round(l2 / allowance, 2) if allowance > 0 else
               (0.0 if l2 == 0 else math.inf), round(self.memory_factor, 4), self.arms.stage, self.arms.contender,
               self.arms.label)
        start = time.perf_counter()
        keep = self.all_units(KEEP)
        cached = (keep, False) if self._keeps_all(tokens, row) else self._cache.get(key)
        if cached is None:
            try:  # plan for the bucket's largest micro-batch, so the cached plan fits all of the bucket
                cached = self._cache[key] = self.search.choose(l2, bucket, allowance, bucket_row)
            except Infeasible:  # a fixed budget can fit this micro-batch but not the whole bucket
                cached = self.search.choose(l2, tokens, allowance, row)
        plan, choice = cached
        peak = self.predicted_peak(plan, tokens)
        if peak > self.limit(row):
            # a gc_ratio budget shrinks with the micro-batch while fixed costs do not: the bucket's
            # plan can overshoot a micro-batch far below the bucket's size; solve for this one
            plan, choice = self.search.choose(l2, tokens, allowance, row)
            peak = self.predicted_peak(plan, tokens)
        if not gradients:
            peak = self.predicted_peak(plan, tokens, gradients=False)
        self.arms.informative |= choice
        self.step_time.planned(self.predicted_step_seconds(plan, tokens, measured=False))
        self._size_s += self.costs.pass_seconds(self.gc_plan(), tokens)  # the arms' measure of size
        solve_ms = (time.perf_counter() - start) * 1e3
        unit_plans = self.runtime_plan(plan)
        predicted_risk = self.risk.predict(unit_plans, l2) if self.risk is not None else 0.0
        self.history.append(PlanRecord(plan, peak, predicted_risk, allowance, solve_ms))
        self._predicted_peaks.append(peak)
        if len(self.history) > HISTORY_KEPT:  # a long run plans millions of micro-batches
            del self.history[:-HISTORY_KEPT // 4]
        return plan

    def _keeps_all(self, tokens: int, row: int) -> bool:
        """Every unit kept, where it fits this micro-batch: the fastest plan, whatever the bucket's rounding."""
        return self.predicted_peak(self.all_units(KEEP), tokens) <= self.limit(row)

    def runtime_plan(self, plan: dict[str, UnitPlan]) -> dict[str, UnitPlan]:
        """`plan` as the runtime runs it: compressed units round stochastically when the controller was
        built with `stochastic=True` (the cost table prices a format the same either way)."""
        return {unit: self.as_run(p) for unit, p in plan.items()}

    def as_run(self, plan: UnitPlan) -> UnitPlan:
        return dataclasses.replace(plan, stochastic=True) if self.stochastic and not plan.exact else plan

    def all_units(self, plan: UnitPlan) -> dict[str, UnitPlan]:
        """`plan` for every unit."""
        return {u.name: plan for u in self.costs.units}

    def held_bytes(self, plan: dict[str, UnitPlan], tokens: int) -> float:
        """Predicted bytes held at the end of the forward: the plan's units plus unmanaged state."""
        held = self.costs.held(plan, tokens)
        k = self.costs.scale(tokens)
        if self.costs.region_saving_bytes and self.runtime is not None:
            held -= self.costs.region_saving_bytes * k * self.runtime.whole_blocks(self.runtime_plan(plan))
        return held + self.costs.unmanaged(tokens)

    # ------------------------------------------------------------------ read-only: a plan's predicted step time
    def predicted_step_seconds(self, plan: dict[str, UnitPlan], tokens: int, measured: bool = True) -> float:
        """One forward + backward under `plan` at `tokens`, as the cost model prices it (`CostTable.pass_seconds`:
        the probe's measured pass) and, unless the plan runs hands-off (every unit kept, or the model's own
        checkpointing), the runtime's measured overhead; times the measured scale of the timed mini-batches
        (planner/step_time.py: it carries the optimizer step and what the model misses), unless `measured`
        is False."""
        overhead = 0.0 if plan in self.hands_off_plans() else self.costs.runtime_overhead_s
        modelled = self.costs.pass_seconds(plan, tokens) + overhead
        return modelled * self.step_time.value if measured else modelled

    def hands_off_plans(self) -> list[dict[str, UnitPlan]]:
        """The exact plans the runtime runs without its hooks: every unit kept, and HF checkpointing as the
        model had it (where it had any)."""
        checkpoint = self.runtime.checkpoint_plan() if self.runtime is not None else None
        return [self.all_units(KEEP)] + ([checkpoint] if checkpoint is not None else [])

    def after_forward(self, index: int, exposure_l2_exact: Exact) -> None:
        """The exact exposure of the micro-batch just planned (after its forward, before its backward), for
        the risk it actually spent: recorded now, or kept unread until `record_spent` (planner/spent.py)."""
        if self.history and self.risk is not None:
            self.spent.note(self.history[-1], exposure_l2_exact)

    def record_spent(self) -> None:
        """Read the exact exposures `after_forward` kept (one transfer) and record the risk each micro-batch
        spent; called once per mini-batch, after its last backward."""
        self.spent.read()

    def discard_unread(self) -> None:
        """Forget the exact exposures of a mini-batch that failed (its risk spent stays unrecorded)."""
        self.spent.discard()

    def end_mini_batch(self, measured_peak_bytes: float | None = None, noise_bytes: float = 0.0) -> None:
        """The mini-batch's measured peak (the maximum over ranks; None: not measured) against the largest
        peak its plans predicted and the largest micro-batch's budget: the measured-peak feedback
        (planner/peak_feedback.py) plans later mini-batches tighter or looser. `noise_bytes`: how far the
        measurement moves for reasons of its own (peak_memory.py)."""
        if measured_peak_bytes is None or not self._predicted_peaks:
            return
        budget = max(self.memory_budget_at(row) for _, _, row in self._micro)
        if self.peaks.update(measured_peak_bytes, max(self._predicted_peaks), budget, noise_bytes):
            self._cache.clear()

    def audit_due(self, step: int) -> bool:
        """Whether the integration should compute an exact gradient next to this step's approximate one
        (never while the risk model is not calibrated: every plan is exact then)."""
        return self.audit is not None and self.risk.calibrated and self.audit.due(step)

    def calibrated(self) -> None:
        """The risk model was calibrated after the controller was built (its first mini-batch had no loss
        term): plans made from now on may compress."""
        self._cache.clear()

    def audit_micro_batch(self, step: int, exposure_l2: list[float] | None = None) -> int | None:
        """Which micro-batch of this mini-batch to audit at `step`: one with exposure, rotating over
        them from one audit to the next; None (skip the audit) when no micro-batch has any.

        `exposure_l2`: the global (all-reduced) exposure per micro-batch to choose by (default: the
        ones `begin_mini_batch` all-reduced). The choice depends on nothing else, so every
        data-parallel rank audits the same micro-batch index, as the audit's all-reduce needs."""
        exposures = [m[0] for m in self._micro] if exposure_l2 is None else list(exposure_l2)
        candidates = [i for i, l2 in enumerate(exposures) if l2 > 0]
        if not candidates:
            return None
        every = self.audit.every if self.audit is not None else 1
        return candidates[(step // every) % len(candidates)]

    def record_audit(self, step: int, exact: torch.Tensor, approx: torch.Tensor, exposure_l2: float,
                     reduce: Callable[[torch.Tensor], None] | None = None):
        """Feed an audit (exact vs approximate gradient of a sampled micro-batch under the last plan);
        the audit re-scales sensitivities and may tighten the risk budget, which the next plans use.
        `exact`, `approx`: flat gradients, or this rank's shards with `reduce` summing over ranks
        (every rank then records the same result). Returns the AuditResult, or None when the exact
        gradient was zero (nothing recorded or changed). The result's metrics are part of `metrics()`
        until the next `begin_mini_batch`."""
        self.record_spent()  # under the risk model the audit is about to re-scale
        result = self.audit.run(step, exact, approx, self.runtime_plan(self.history[-1].plan), exposure_l2,
                                self.risk_budget, reduce=reduce)
        if result is None:
            return None
        self._audit_result = result
        self.risk_budget = result.risk_budget
        self._cache.clear()
        return result

    def on_oom(self) -> None:
        """After an out-of-memory retry: plan 10% tighter from now on."""
        self.oom_factor *= 0.9
        self._cache.clear()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What a resumed run needs to continue calibrated: costs, risk model, budgets, audit state.
        Plain numbers, names and lists: `dump_state` writes it as JSON, `load_state` validates it."""
        return {"costs": dataclasses.asdict(self.costs), "risk": self.risk.state_dict() if self.risk else None,
                "risk_budget": self.risk_budget, "memory_factor": self.oom_factor}

    def load_state_dict(self, state: dict) -> None:
        """Budgets and audit state (costs and risk model are passed to the constructor: planner/state.py's
        `costs_of` and `risk_of` read them from the same state)."""
        self.risk_budget = state["risk_budget"]
        self.oom_factor = state["memory_factor"]  # the measured-peak factor is measured again
        self._cache.clear()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """The last plan's figures (reads the exact exposures kept unread: `record_spent`)."""
        self.record_spent()
        if not self.history:
            return {}
        last = self.history[-1]
        counts: dict[str, int] = {}
        for p in last.plan.values():
            mode = p.fmt or p.mode.value
            counts[mode] = counts.get(mode, 0) + 1
        out = {f"hilore/plan/units_{m}": float(n) for m, n in counts.items()}
        out.update(self.arms.metrics())
        out.update({"hilore/plan/predicted_peak_gib": last.predicted_peak / 2**30,
                    "hilore/plan/budget_gib": self.memory_budget_at(self._micro[-1][2]) * self.memory_factor / 2**30,
                    "hilore/plan/risk_predicted": last.predicted_risk, "hilore/plan/risk_allowance": last.risk_allowance,
                    "hilore/plan/solver_ms": last.solve_ms, "hilore/plan/step_time_scale": self.step_time.value})
        if self.risk is not None:
            out["hilore/risk_calibrated"] = float(self.risk.calibrated)
        out.update(self.peaks.metrics())
        if last.spent_risk is not None:
            out["hilore/plan/risk_spent"] = last.spent_risk
        if self._audit_result is not None:  # only in the mini-batch whose audit ran
            out.update(self._audit_result.metrics())
        return out


__all__ = ["Controller", "Infeasible", "PlanRecord"]
