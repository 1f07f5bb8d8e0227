"""Plans: which mode each recovery unit's saved tensors get. The runtime executes them; it decides nothing."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from hilore_verl.kernels import FORMATS, GROUP_SIZES


class Mode(str, enum.Enum):
    KEEP = "keep"
    """Saved tensors stay as they are (training precision)."""
    COMPRESS = "compress"
    """Saved tensors are quantized (UnitPlan.fmt) and dequantized in backward."""
    RECOMPUTE = "recompute"
    """Saved tensors are dropped and regenerated in backward by re-running the producing module."""


MODE_NAMES = ("keep", "recompute") + FORMATS  # the short strings a plan mapping may use


@dataclass(frozen=True)
class UnitPlan:
    mode: Mode = Mode.KEEP
    """A Mode, or its string value ("keep" | "compress" | "recompute"), stored as the Mode."""
    fmt: str | None = None
    """Codec format for COMPRESS: "int8" | "fp8" | "int4"."""
    group_size: int = 64
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
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(f"UnitPlan.group_size: got {self.group_size!r}; valid: an integer, one of {GROUP_SIZES}")
        for key in ("offload", "stochastic"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"UnitPlan.{key}: got {getattr(self, key)!r}; valid: True or False")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size {self.group_size} is not supported; valid: {GROUP_SIZES}")
        if self.mode == Mode.COMPRESS:
            if self.fmt not in FORMATS:
                raise ValueError(f"unknown compression format {self.fmt!r}; valid formats: {', '.join(FORMATS)}")
        elif self.fmt is not None or self.offload or self.stochastic:
            raise ValueError(f"fmt, offload and stochastic apply to compressed units only, not to {self.mode.value!r}")

    @staticmethod
    def parse(value: Union[str, "UnitPlan", Mode]) -> "UnitPlan":
        if isinstance(value, UnitPlan):
            return value
        if isinstance(value, Mode) and value != Mode.COMPRESS:
            return UnitPlan(value)
        if isinstance(value, str) and value in FORMATS:
            return UnitPlan(Mode.COMPRESS, fmt=value)
        if isinstance(value, str) and value in ("keep", "recompute"):
            return UnitPlan(Mode(value))
        raise ValueError(f"unknown mode {value!r}; valid modes: {', '.join(MODE_NAMES)} (or a UnitPlan)")

    def __str__(self) -> str:
        if self.mode != Mode.COMPRESS:
            return self.mode.value
        return f"{self.fmt}/g{self.group_size}" + ("+sr" if self.stochastic else "") + ("+offload" if self.offload else "")


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
