"""The `hilore:` config section (beside verl's actor config): typed, validated before any model is built.

    actor_rollout_ref.actor.hilore:
      enable: true
      budget: {mode: gc_ratio, value: 1.10}
      risk_budget: 0.01
      formats: [int8, fp8, int4]

Every field is listed with its type, default, range and effect in docs/config.md. Unknown keys,
wrong types and out-of-range values raise ValueError naming the key and what is valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from hilore_verl.kernels import FORMATS, GROUP_SIZES
from hilore_verl.planner.budget import MODES, BudgetConfig


@dataclass(frozen=True)
class HiLoReConfig:
    enable: bool = False
    """Turn HiLoRe on for the actor update (off: stock verl, untouched)."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """Memory budget of the actor update: gc_ratio x the full-recompute peak, gib, or auto."""
    risk_budget: float = 0.01
    """Allowed predicted relative gradient error per mini-batch; 0 allows only keep / recompute."""
    formats: tuple[str, ...] = FORMATS
    """Compression formats the planner may use: one or more of int8, fp8, int4, no repeats (risk_budget 0
    forbids compression; an empty list is refused)."""
    group_size: int = 64
    """Elements per quantization scale."""
    offload: bool = False
    """Let the planner also offload compressed payloads to host memory."""
    stochastic_rounding: bool = False
    """Round compressed values stochastically (unbiased) instead of to nearest."""
    min_bytes: int = 16384
    """Saved tensors smaller than this are always kept."""
    audit_every: int = 50
    """Steps between gradient audits (0: no audit)."""
    audit_tolerance: float = 2.0
    """Measured / predicted gradient error above this is an anomaly: the risk budget halves."""
    token_bucket: int = 256
    """Plans are cached per bucket of tokens per micro-batch."""
    profile_tokens: int = 2048
    """Token bound of the first step's probe (whole sequences of a micro-batch, at least one), which
    profiling and calibration run on; the figures scale by tokens. The probe also takes at most 1/8 of
    the rank's tokens in that step (0 here: only that bound)."""
    seed: int = 0
    """Seed of stochastic rounding."""
    oom_retries: int = 1
    """Times a mini-batch that ran out of device memory is retried with every unit recomputed."""
    step_snapshot: bool = True
    """Copy this rank's stepped parameter shards and optimizer state to host memory when each mini-batch
    starts (on a GPU on a side stream, overlapped with its passes; the step waits for the copies on the
    device only), so that a fault inside the optimizer step is undone (an out-of-memory error then
    retried by running the mini-batch again). False: such a fault stops training with StepFailed
    (resume from a checkpoint)."""
    skip_zero_exposure: bool = True
    """Leave out of the actor's forward and backward every sequence whose loss term is zero for any log-probs
    (all advantages 0 under a loss proportional to the advantage, no KL loss, no entropy bonus); the loss
    normalisation stays stock verl's, so the update is unchanged up to floating-point reordering. Under a
    loss it cannot prove safe it trains without skipping and says so once."""
    measure_baseline: bool = True
    """Where the solver's plan differs from an exact baseline the runtime runs hands-off (the model's own
    checkpointing, or every unit kept), time both in training and run the faster (planner/arms.py). With
    keep / recompute plans both give the same update bitwise; with lossy plans which one runs depends on
    measured time, so two runs from one seed may differ (within the risk budget). False: the cost model
    decides alone and such runs repeat exactly."""
    shared_prompt: bool = False
    """Compute each group's prompt once in the actor's forward and backward: sequences of a micro-batch
    whose prompts are equal (compared by tokens) are laid out as one prompt followed by their responses
    (hilore_verl/shared_prompt/); verl's log-probs, loss and metrics are computed from the same logits.
    Micro-batches it cannot serve (no remove-padding, sequence parallelism, fused kernels, multi-modal
    inputs) and models with attention sinks run in the ordinary layout, each reason logged once."""
    fault_timeout_s: float = 60.0
    """After an out-of-memory error, how long a rank waits for the others to report the same fault
    before it stops training (a fault on some ranks only cannot be retried)."""

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> "HiLoReConfig":
        section = {} if section is None else _plain(section)
        if not isinstance(section, dict):  # "", 0, false, [] are mistakes too, not an empty section
            raise ValueError(f"hilore: expected a mapping of settings (or null for the defaults), "
                             f"got {type(section).__name__} {section!r}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(section) - set(valid))
        if unknown:
            raise ValueError(f"hilore.{unknown[0]}: unknown key; valid keys: {', '.join(valid)}")
        values = dict(section)
        if "budget" in values:
            values["budget"] = _budget(values["budget"])
        if "formats" in values:
            values["formats"] = _formats(values["formats"])
        return cls(**values)

    def __post_init__(self):
        _check_type("enable", self.enable, bool)
        _check_type("offload", self.offload, bool)
        _check_type("stochastic_rounding", self.stochastic_rounding, bool)
        _check_type("step_snapshot", self.step_snapshot, bool)
        _check_type("skip_zero_exposure", self.skip_zero_exposure, bool)
        _check_type("measure_baseline", self.measure_baseline, bool)
        _check_type("shared_prompt", self.shared_prompt, bool)
        _check_number("fault_timeout_s", self.fault_timeout_s, "> 0", lambda v: v > 0)
        _check_number("risk_budget", self.risk_budget, ">= 0", lambda v: v >= 0)
        _check_number("audit_tolerance", self.audit_tolerance, "> 1", lambda v: v > 1)
        _check_int("min_bytes", self.min_bytes, ">= 0", lambda v: v >= 0)
        _check_int("audit_every", self.audit_every, ">= 0", lambda v: v >= 0)
        _check_int("token_bucket", self.token_bucket, ">= 1", lambda v: v >= 1)
        _check_int("profile_tokens", self.profile_tokens, ">= 0", lambda v: v >= 0)
        _check_int("seed", self.seed, "any integer", lambda v: True)
        _check_int("oom_retries", self.oom_retries, "in 0..10", lambda v: 0 <= v <= 10)
        _check_int("group_size", self.group_size, f"one of {GROUP_SIZES}", lambda v: v in GROUP_SIZES)
        object.__setattr__(self, "budget", _budget(self.budget))
        object.__setattr__(self, "formats", _formats(self.formats))  # a tuple is checked too


def _plain(value):
    """OmegaConf containers (what hydra gives) as plain dicts and lists."""
    if hasattr(value, "_metadata") and hasattr(value, "items"):  # DictConfig
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "_metadata"):  # ListConfig
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _budget(value) -> BudgetConfig:
    value = _plain(value)
    if isinstance(value, BudgetConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"hilore.budget: expected {{mode: ..., value: ...}} with mode one of {', '.join(MODES)}; "
                         f"got {value!r}")
    unknown = sorted(set(value) - {"mode", "value"})
    if unknown:
        raise ValueError(f"hilore.budget.{unknown[0]}: unknown key; valid keys: mode, value")
    if value.get("mode", "gc_ratio") != "gc_ratio" and "value" not in value:
        raise ValueError(f"hilore.budget.value: required with mode {value['mode']} "
                         "(gib: the budget in GiB, e.g. 40; auto: GiB of headroom, e.g. 2)")
    try:
        return BudgetConfig(**value)
    except ValueError as err:
        raise ValueError(f"hilore.budget: {err}") from None


def _formats(value) -> tuple[str, ...]:
    """A list (or one name) of formats; a mapping, a number or an empty list is an error, not a guess."""
    value = _plain(value)
    if not isinstance(value, (str, list, tuple)):
        raise ValueError(f"hilore.formats: expected a list of formats, some of {', '.join(FORMATS)}; "
                         f"got {type(value).__name__} {value!r}")
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise ValueError(f"hilore.formats: empty; list at least one of {', '.join(FORMATS)} "
                         "(to forbid compression, set risk_budget: 0)")
    bad = [f for f in items if not isinstance(f, str) or f not in FORMATS]
    if bad:
        raise ValueError(f"hilore.formats: unknown format {bad[0]!r}; valid: {', '.join(FORMATS)}")
    twice = [f for i, f in enumerate(items) if f in items[:i]]
    if twice:
        raise ValueError(f"hilore.formats: {twice[0]!r} is listed twice; list each format once")
    return tuple(items)


def _check_type(key, value, kind) -> None:
    if not isinstance(value, kind):
        raise ValueError(f"hilore.{key}: expected {kind.__name__}, got {value!r}")


def _finite(value) -> bool:
    """A float that is finite, or an int a float can hold (10**400 is not)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _check_number(key, value, valid, ok) -> None:
    """int or float (never bool, never a str), finite, and in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or not ok(value):
        raise ValueError(f"hilore.{key}: got {value!r}; valid: a finite number {valid}")


def _check_int(key, value, valid, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"hilore.{key}: got {value!r}; valid: an integer {valid}")
