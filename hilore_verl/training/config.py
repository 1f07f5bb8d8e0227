"""The `hilore:` config section (beside verl's actor config): typed, validated before any model is built.

    actor_rollout_ref.actor.hilore:
      enable: true
      budget: {mode: gc_ratio, value: 1.10}
      risk_budget: 0.01
      formats: [int8, fp8, int4]

Every field is listed with its type, default, range and effect in docs/config.md. Unknown keys,
wrong types and out-of-range values raise ValueError naming the key and what is valid (checks.py:
one check for every setting, here, in BudgetConfig, RuntimeConfig, UnitPlan and the saved state).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from hilore_verl.validation import checks
from hilore_verl.kernels import FORMATS, GROUP_SIZES
from hilore_verl.planner.budget import MODES, BudgetConfig
from hilore_verl.runtime import RuntimeConfig


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
    checkpointing, or every unit kept), time both in training and run the plans only where they measure
    faster (a 95% interval over paired mini-batches), the baseline otherwise (planner/arms.py). With
    keep / recompute plans both give the same update bitwise; with lossy plans which one runs depends on
    measured time, so two runs from one seed may differ (within the risk budget). False: the cost model
    decides alone and such runs repeat exactly."""
    shared_prompt: bool = True
    """Compute each group's prompt once in the actor's forward and backward: sequences of a micro-batch
    whose prompts are equal (compared by tokens) are laid out as one prompt followed by their responses
    (hilore_verl/shared_prompt/); verl's log-probs, loss and metrics are computed from the same logits.
    On where it applies: micro-batches it cannot serve (no remove-padding, fused kernels, multi-modal
    inputs) and models with attention sinks or non-attention token mixers run in the ordinary layout,
    each reason logged once. The first micro-batch it would share is also computed per sequence; if the
    log-probs disagree beyond the bound for the compute dtype (fp32 max 1e-3 / mean 1e-4; bf16 0.5 /
    0.02; fp16 0.1 / 0.005) or the shared forward fails, sharing is off for the run with one warning
    (`actor/hilore/shared_prompt_on`)."""
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
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                checks.flag(f"hilore.{f.name}", value)
            elif f.name in RANGES:
                kind, valid, ok = RANGES[f.name]
                kind(f"hilore.{f.name}", value, valid, ok)
        object.__setattr__(self, "budget", _budget(self.budget))
        object.__setattr__(self, "formats", _formats(self.formats))  # a tuple is checked too

    def runtime_config(self) -> RuntimeConfig:
        """The runtime's settings, derived from this section (the planner's are read by `Session`)."""
        return RuntimeConfig(min_bytes=self.min_bytes, seed=self.seed)


RANGES = {  # every number of the section: its check, what is valid, the test
    "risk_budget": (checks.number, ">= 0", lambda v: v >= 0),
    "audit_tolerance": (checks.number, "> 1", lambda v: v > 1),
    "fault_timeout_s": (checks.number, "> 0", lambda v: v > 0),
    "min_bytes": (checks.integer, ">= 0", lambda v: v >= 0),
    "audit_every": (checks.integer, ">= 0", lambda v: v >= 0),
    "token_bucket": (checks.integer, ">= 1", lambda v: v >= 1),
    "profile_tokens": (checks.integer, ">= 0", lambda v: v >= 0),
    "seed": (checks.integer, "", lambda v: True),
    "oom_retries": (checks.integer, "in 0..10", lambda v: 0 <= v <= 10),
    "group_size": (checks.integer, f"one of {GROUP_SIZES}", lambda v: v in GROUP_SIZES),
}


def _plain(value):
    """OmegaConf containers (what hydra gives) as plain dicts and lists."""
    if hasattr(value, "_metadata"):  # a DictConfig or ListConfig: omegaconf is installed
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
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
    # value null: the mode's default (gc_ratio's 1.10), so that a recipe's budget.mode=auto or =gib on
    # the command line cannot take a ratio meant for gc_ratio as GiB
    value = {k: v for k, v in value.items() if not (k == "value" and v is None)}
    if value.get("mode", "gc_ratio") != "gc_ratio" and "value" not in value:
        raise ValueError(f"hilore.budget.value: required with mode {value['mode']} "
                         "(gib: the budget in GiB, e.g. 40; auto: GiB of headroom, e.g. 2)")
    try:
        return BudgetConfig(**value)
    except ValueError as err:  # "budget.value: ...": the key as the section spells it
        raise ValueError(f"hilore.{err}") from None


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
