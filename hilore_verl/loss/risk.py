"""Risk: how much a plan's lossy units move the policy gradient, calibrated against measured error.

    risk(unit, mode, micro-batch) = sensitivity[unit] * codec_error(mode) * exposure_l2(micro-batch)

`exposure_l2` = sqrt(sum_t c_t^2) over the micro-batch's tokens (hilore_verl.loss.exposure): a unit's
per-element codec error e reaches the gradient sum_t c_t grad log p_t through every token, as
independent errors, so its effect grows with the L2 norm of c. Units' errors add in quadrature:

    predicted |g_approx - g_exact| = sqrt( sum_u risk(u)^2 )

`codec_error(fmt, g)` is the codec's measured relative RMS error (torch reference on unit Gaussian
data). Sensitivities are measured (`calibrate`: compress one unit at a time and measure the
gradient deviation from exact) and kept honest online (`GradientAudit`: every K steps, exact vs
approximate gradient on a sampled micro-batch, which re-scales the sensitivities and tightens or
loosens the risk budget). The risk budget is a relative gradient error: predicted deviation over
|g_exact|, with |g_exact| ~ grad_scale * exposure_l2 (grad_scale measured too).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

import torch

from hilore_verl.kernels import FORMATS, reference
from hilore_verl.runtime.plan import RECOMPUTE, Mode, UnitPlan
from hilore_verl.model.units import representatives, name_in_layer

PlanLike = Mapping[str, Union[str, UnitPlan]]


@functools.cache
def codec_error(fmt: str, group_size: int = 64, stochastic: bool = False) -> float:
    """Relative RMS error |x' - x| / |x| of the codec on N(0, 1) data (measured once, deterministic).
    Stochastic rounding is unbiased but has a larger RMS error than rounding to nearest (about 1.4x)."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    y = reference.dequantize(reference.quantize(x, fmt, group_size, stochastic=stochastic))
    return float((y - x).norm() / x.norm())


def _lossy(plan: Union[str, UnitPlan]) -> tuple[str, int, bool] | None:
    """(format, group size, stochastic) of a compressed unit's plan; None for keep / recompute (offload
    does not change the error)."""
    p = UnitPlan.parse(plan)
    return (p.fmt, p.group_size, p.stochastic) if p.mode == Mode.COMPRESS else None


@dataclass
class RiskModel:
    sensitivity: dict[str, float] = field(default_factory=dict)
    """Per unit: gradient deviation per unit of (codec error x exposure_l2)."""
    grad_scale: float | None = None
    """|g_exact| / exposure_l2, measured: turns predicted deviations into relative errors."""
    _log_sum: dict[str, float] = field(default_factory=dict, repr=False)
    _count: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def calibrated(self) -> bool:
        """Whether some unit's sensitivity and the gradient's scale were measured. Until then no lossy unit
        can be priced: a planner plans exactly (keep / recompute) and calibrates again at the first
        micro-batch with a loss term (every probe of a zero-exposure micro-batch is ignored)."""
        return bool(self.sensitivity) and bool(self.grad_scale)

    def sensitivity_of(self, unit: str) -> float:
        """Calibrated value, or the largest calibrated one (conservative) for a unit never measured."""
        if unit in self.sensitivity:
            return self.sensitivity[unit]
        if not self.sensitivity:
            raise ValueError("the risk model is not calibrated (no probe had exposure): plan exactly until it is")
        return max(self.sensitivity.values())

    def unit_risk(self, unit: str, plan: Union[str, UnitPlan], exposure_l2: float) -> float:
        lossy = _lossy(plan)
        return 0.0 if lossy is None else self.sensitivity_of(unit) * codec_error(*lossy) * exposure_l2

    def predict(self, plans: PlanLike, exposure_l2: float) -> float:
        """Predicted |g_approx - g_exact| for the plan on a micro-batch with this exposure."""
        return math.sqrt(sum(self.unit_risk(u, p, exposure_l2) ** 2 for u, p in plans.items()))

    def add_measurement(self, unit: str, fmt: str, group_size: int, exposure_l2: float, measured: float) -> None:
        """One probe: the deviation measured with only `unit` compressed."""
        if exposure_l2 <= 0 or measured <= 0:
            return  # a zero-exposure micro-batch says nothing about sensitivity
        s = measured / (codec_error(fmt, group_size) * exposure_l2)
        self._log_sum[unit] = self._log_sum.get(unit, 0.0) + math.log(s)
        self._count[unit] = self._count.get(unit, 0) + 1
        self.sensitivity[unit] = math.exp(self._log_sum[unit] / self._count[unit])  # geometric mean

    def share(self, unit: str, measured: str) -> None:
        """`unit` takes the calibration of `measured` (a unit of the same kind), from then on its own."""
        self.sensitivity[unit] = self.sensitivity[measured]
        self._log_sum[unit], self._count[unit] = self._log_sum[measured], self._count[measured]

    def rescale(self, units: Sequence[str], factor: float) -> None:
        """Multiply the sensitivities of `units` (what an audit does when reality disagrees)."""
        for unit in units:
            self.sensitivity[unit] = self.sensitivity_of(unit) * factor
            if unit in self._log_sum:
                self._log_sum[unit] += math.log(factor) * self._count[unit]

    def state_dict(self) -> dict:
        return {"sensitivity": dict(self.sensitivity), "grad_scale": self.grad_scale,
                "log_sum": dict(self._log_sum), "count": dict(self._count)}

    def load_state_dict(self, state: dict) -> None:
        self.sensitivity = dict(state["sensitivity"])
        self.grad_scale = state["grad_scale"]
        self._log_sum, self._count = dict(state["log_sum"]), dict(state["count"])


Gradient = Union[torch.Tensor, Sequence[Union[torch.Tensor, None]]]
"""A flat gradient, or this rank's gradient as one tensor per parameter (None: no gradient), as the
passes leave them: the audit and calibration read them in place, never as one concatenated copy."""
GradFn = Callable[[PlanLike], Gradient]
SUM_CHUNK = 2**20  # elements per float64 partial sum: three such chunks are the sums' whole extra memory


def gradient_sums(exact: Gradient, approx: Gradient) -> torch.Tensor:
    """[|a - e|^2, |e|^2, |a|^2, e.a] in float64 over two gradients of one layout, summed chunk by chunk
    (SUM_CHUNK elements) in three float64 buffers allocated once (24 MiB): not a float64 copy of the
    gradient, at the moment device memory is tightest, and no allocation per chunk for the allocator to
    keep."""
    exact = [exact] if isinstance(exact, torch.Tensor) else list(exact)
    approx = [approx] if isinstance(approx, torch.Tensor) else list(approx)
    if len(exact) != len(approx):
        raise ValueError(f"gradients of different layouts: {len(exact)} and {len(approx)} tensors")
    present = [t for t in exact + approx if t is not None]
    device = present[0].device if present else torch.device("cpu")
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    if not present:
        return sums
    size = min(SUM_CHUNK, max(t.numel() for t in present))
    buf_e, buf_a, buf_d = (torch.empty(size, dtype=torch.float64, device=device) for _ in range(3))
    for e, a in zip(exact, approx):
        if e is None and a is None:
            continue
        if e is not None and a is not None and e.numel() != a.numel():
            raise ValueError(f"gradients of different layouts: {e.numel()} and {a.numel()} elements")
        numel = (e if e is not None else a).numel()
        e = None if e is None else e.detach().reshape(-1)  # None: a parameter one pass left without a gradient
        a = None if a is None else a.detach().reshape(-1)
        for start in range(0, numel, SUM_CHUNK):
            n = min(SUM_CHUNK, numel - start)
            ce, ca, cd = buf_e[:n], buf_a[:n], buf_d[:n]
            ce.copy_(e[start:start + n]) if e is not None else ce.zero_()
            ca.copy_(a[start:start + n]) if a is not None else ca.zero_()
            torch.sub(ca, ce, out=cd)
            sums += torch.stack([cd.dot(cd), ce.dot(ce), ca.dot(ca), ce.dot(ca)])
    return sums


def calibrate(grad_fn: GradFn, units: Sequence[str], exposure_l2: float, fmts: Sequence[str] = FORMATS,
              group_size: int = 64, model: RiskModel | None = None, base: PlanLike | None = None) -> RiskModel:
    """Probe: compress one unit at a time (each format) and measure the gradient deviation from exact.

    `grad_fn(plan)` runs forward + backward of one micro-batch under `plan` and returns the flat
    gradient; `exposure_l2` is that micro-batch's. Every probe runs under `base` (default: all
    kept) with one unit compressed on top: GC's plan keeps the probes within GC's memory, and
    recompute is exact. Call again on more micro-batches (passing `model`) to average;
    sensitivities are geometric means over every probe.
    """
    model = model or RiskModel()
    base = dict(base or {})
    exact = grad_fn(base)
    exact_norm = math.sqrt(gradient_sums(exact, exact)[1].item())
    scale = exact_norm / exposure_l2 if exposure_l2 > 0 else None
    if scale:
        model.grad_scale = scale if model.grad_scale is None else math.sqrt(model.grad_scale * scale)
    for unit in units:
        for fmt in fmts:
            approx = grad_fn({**base, unit: UnitPlan(Mode.COMPRESS, fmt=fmt, group_size=group_size)})
            deviation = math.sqrt(gradient_sums(exact, approx)[0].item())
            model.add_measurement(unit, fmt, group_size, exposure_l2, deviation)
    return model


def calibrate_by_group(grad_fn: GradFn, units: Sequence[str], exposure_l2: float, fmts: Sequence[str] = FORMATS,
                      group_size: int = 64, model: RiskModel | None = None,
                      groups: dict[str, str] | None = None) -> RiskModel:
    """`calibrate` on one unit per group (`groups`: unit -> group, default the name within the layer;
    the middle layer's, and the head), under GC's plan; every unit of a group then shares its
    sensitivity (audits re-scale units one by one afterwards)."""
    groups = groups or {n: name_in_layer(n) for n in units}
    reps = representatives(list(units), groups)
    gc_plan = {n: RECOMPUTE for n in units if n.startswith("layers.")}
    model = calibrate(grad_fn, list(reps.values()), exposure_l2, fmts, group_size, model, base=gc_plan)
    for n in units:
        rep = reps[groups[n]]
        if rep in model.sensitivity and n != rep:
            model.share(n, rep)
    return model


@dataclass
class AuditResult:
    step: int
    cosine: float
    rel_error: float
    measured: float
    predicted: float
    ratio: float  # measured / predicted
    anomaly: bool
    risk_budget: float

    def metrics(self) -> dict[str, float]:
        return {"hilore/audit/cosine": self.cosine, "hilore/audit/rel_error": self.rel_error,
                "hilore/audit/measured": self.measured, "hilore/audit/predicted": self.predicted,
                "hilore/audit/ratio": self.ratio, "hilore/audit/anomaly": float(self.anomaly),
                "hilore/risk_budget": self.risk_budget}


@dataclass
class GradientAudit:
    """Every `every` steps: exact vs approximate gradient on a sampled micro-batch (one with exposure).

    The measured deviation re-scales the sensitivities of the plan's lossy units (fully when it
    is off by more than `tolerance`, by `learning_rate` in log space otherwise). A deviation above
    `tolerance` x predicted is an anomaly: the risk budget halves. Within tolerance and below the
    budget, the budget relaxes by 10% towards `ceiling`. The budget in effect is the controller's
    (`Controller.risk_budget`, checkpointed there): `run` takes it and returns the next one.
    """

    risk: RiskModel
    ceiling: float = 0.01  # the configured risk budget (hilore.risk_budget): relaxing stops here
    every: int = 50
    tolerance: float = 2.0
    learning_rate: float = 0.3
    min_budget: float = 1e-5
    history: list[AuditResult] = field(default_factory=list)

    def __post_init__(self):
        if self.every < 1 or self.tolerance <= 1 or self.ceiling <= 0:
            raise ValueError("need every >= 1, tolerance > 1 and ceiling > 0")

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def run(self, step: int, exact: torch.Tensor, approx: torch.Tensor, plans: PlanLike, exposure_l2: float,
            risk_budget: float, reduce: Callable[[torch.Tensor], None] | None = None) -> AuditResult | None:
        """`exact`, `approx`: gradients (`Gradient`: flat, or this rank's shards one tensor per parameter,
        with `reduce` summing a float64 vector in place over the ranks that hold the other shards); `risk_budget`: the budget
        the plan was made under. The result carries the budget for the plans after it.

        Returns None, and changes nothing (no history, no sensitivity moved), when the
        exact gradient is zero or not finite: there is no cosine or relative error to measure then
        (a micro-batch without exposure), and a zero deviation from it says nothing about the plan."""
        sums = gradient_sums(exact, approx)  # |a - e|^2, |e|^2, |a|^2, e.a
        if reduce is not None:
            reduce(sums)
        diff2, exact2, approx2, dot = sums.tolist()
        if not (math.isfinite(exact2) and exact2 > 0):
            return None
        if math.isfinite(diff2) and math.isfinite(approx2) and math.isfinite(dot):
            measured = math.sqrt(diff2)
            cosine = dot / max(math.sqrt(exact2 * approx2), 1e-30)
        else:  # a non-finite approximate gradient: as far off as it gets
            measured, cosine = math.inf, math.nan
        rel = measured / math.sqrt(exact2)
        predicted = self.risk.predict(plans, exposure_l2)
        lossy = [u for u, p in plans.items() if _lossy(p) is not None]
        ratio = measured / predicted if predicted > 0 else (math.inf if measured > 0 else 1.0)
        anomaly = ratio > self.tolerance
        if lossy and predicted > 0 and 0 < measured < math.inf:
            self.risk.rescale(lossy, ratio if anomaly else ratio ** self.learning_rate)
        if anomaly:
            risk_budget = max(risk_budget / 2, self.min_budget)
        elif rel <= risk_budget:
            risk_budget = min(risk_budget * 1.1, self.ceiling)
        result = AuditResult(step, cosine, rel, measured, predicted, ratio, anomaly, risk_budget)
        self.history.append(result)
        return result
