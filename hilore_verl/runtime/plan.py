"""Plans: which mode each recovery unit's saved tensors get. The runtime executes them; it decides nothing."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from hilore_verl.validation import checks
from hilore_verl.kernels import FORMATS, GROUP_SIZES


class Mode(str, enum.Enum):
    KEEP = "keep"
    """Saved tensors stay as they are (training precision)."""
    COMPRESS = "compress"
    """Saved tensors are quantized (UnitPlan.fmt) and dequantized in backward."""
    RECOMPUTE = "recompute"
    """Saved tensors are dropped and regenerated in backward by re-running the producing module."""


MODE_NAMES = ("keep", "recompute") + FORMATS  # the short strings a plan mapping may use
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True, eq=False)
class UnitPlan:
    """What one recovery unit's saved tensors get. Its one spelling, `str(plan)`, is what logs, metrics
    and reports show: "keep", "recompute", or the format with what differs from the defaults,
    "int8", "int4/g128", "fp8+sr", "int8+offload" (group size, stochastic rounding, offload, in that
    order). A UnitPlan equals, hashes and sorts as its spelling, as `Mode.KEEP == "keep"`: plans compare
    with the names users write, and `UnitPlan.parse` reads every spelling back."""

    mode: Mode = Mode.KEEP
    """A Mode, or its string value ("keep" | "compress" | "recompute"), stored as the Mode."""
    fmt: str | None = None
    """Codec format for COMPRESS: "int8" | "fp8" | "int4"."""
    group_size: int = DEFAULT_GROUP_SIZE
    """Elements per quantization scale (COMPRESS)."""
    offload: bool = False
    """COMPRESS only: move the payload to host memory until backward."""
    stochastic: bool = False
    """COMPRESS only: stochastic rounding (unbiased; seeded from RuntimeConfig.seed) instead of nearest."""

    def __post_init__(self):
        if not isinstance(self.mode, Mode):
            if not isinstance(self.mode, str) or self.mode not in {m.value for m in Mode}:
                raise ValueError(f"UnitPlan.mode: got {self.mode!r}; valid: a Mode or one of "
                                 f"{', '.join(m.value for m in Mode)} (formats go in fmt)")
            object.__setattr__(self, "mode", Mode(self.mode))
        checks.integer("UnitPlan.group_size", self.group_size, f"one of {GROUP_SIZES}", lambda v: v in GROUP_SIZES)
        checks.flag("UnitPlan.offload", self.offload)
        checks.flag("UnitPlan.stochastic", self.stochastic)
        if self.mode == Mode.COMPRESS:
            if self.fmt not in FORMATS:
                raise ValueError(f"unknown compression format {self.fmt!r}; valid formats: {', '.join(FORMATS)}")
        elif self.fmt is not None or self.offload or self.stochastic:
            raise ValueError(f"fmt, offload and stochastic apply to compressed units only, not to {self.mode.value!r}")

    @property
    def exact(self) -> bool:
        """Keep and recompute give the exact gradient; compression does not."""
        return self.mode != Mode.COMPRESS

    @staticmethod
    def parse(value: Union[str, "UnitPlan", Mode]) -> "UnitPlan":
        """A UnitPlan from its spelling (`str(plan)`), a Mode other than COMPRESS, or a UnitPlan."""
        if isinstance(value, UnitPlan):
            return value
        if isinstance(value, Mode) and value != Mode.COMPRESS:
            return UnitPlan(value)
        if isinstance(value, str) and value in ("keep", "recompute"):
            return UnitPlan(Mode(value))
        if isinstance(value, str):
            head, *flags = value.split("+")
            fmt, _, group = head.partition("/g")
            if fmt in FORMATS and set(flags) <= {"sr", "offload"} and len(set(flags)) == len(flags) \
                    and (not group or group.isdigit()):
                plan = UnitPlan(Mode.COMPRESS, fmt=fmt, group_size=int(group) if group else DEFAULT_GROUP_SIZE,
                                offload="offload" in flags, stochastic="sr" in flags)
                if str(plan) == value:  # one spelling: flags in order, the default group size left out
                    return plan
        raise ValueError(f"unknown mode {value!r}; valid modes: {', '.join(MODE_NAMES)}, a format with "
                         f"'/g<group size>', '+sr', '+offload' (e.g. 'int8/g128+sr+offload'), or a UnitPlan")

    def __str__(self) -> str:
        if self.mode != Mode.COMPRESS:
            return self.mode.value
        return (self.fmt + (f"/g{self.group_size}" if self.group_size != DEFAULT_GROUP_SIZE else "")
                + ("+sr" if self.stochastic else "") + ("+offload" if self.offload else ""))

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __repr__(self) -> str:
        return f"UnitPlan({str(self)!r})"

    def __eq__(self, other) -> bool:
        if isinstance(other, UnitPlan):
            return str(self) == str(other)
        if isinstance(other, str):  # a Mode too
            return str(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other) -> bool:  # sorted by spelling
        if isinstance(other, (UnitPlan, str)):
            return str(self) < str(other)
        return NotImplemented


KEEP = UnitPlan(Mode.KEEP)
RECOMPUTE = UnitPlan(Mode.RECOMPUTE)


PlanValue = Union[str, UnitPlan, Mode]


@dataclass
class Plan:
    """Per-unit modes. Keys are unit names or group prefixes ("layers.3", "layers.3.mlp", "head");
    a more specific key wins over a shorter prefix; units named by no key get `default`."""

    units: dict[str, PlanValue] = field(default_factory=dict)
    default: PlanValue = "keep"

    @classmethod
    def of(cls, plan: Union["Plan", Mapping[str, PlanValue]]) -> "Plan":
        return plan if isinstance(plan, Plan) else cls(dict(plan))

    def resolve(self, unit_names: Sequence[str]) -> list[UnitPlan]:
        """One UnitPlan per unit, in the order given; ValueError for a key that names no unit."""
        parsed = {key: UnitPlan.parse(v) for key, v in self.units.items()}
        default = UnitPlan.parse(self.default)
        for key in parsed:
            if not any(name == key or name.startswith(key + ".") for name in unit_names):
                layers = sorted({n.split(".")[1] for n in unit_names if n.startswith("layers.")}, key=int)
                subs = sorted({".".join(n.split(".")[2:]) for n in unit_names if n.startswith("layers.")})
                raise ValueError(f"unknown unit {key!r}; valid: 'layers.<i>' for i in {layers[0]}..{layers[-1]}, "
                                 f"'layers.<i>.<sub>' for sub in {subs} (or 'attn' / 'mlp'), 'head'")
        resolved = []
        for name in unit_names:
            matches = [k for k in parsed if name == k or name.startswith(k + ".")]
            resolved.append(parsed[max(matches, key=len)] if matches else default)
        return resolved
