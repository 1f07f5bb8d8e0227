"""The controller's state as a file: plain JSON, tagged and validated, so that loading it runs no code.

    dump_state(controller.state_dict()) -> text      load_state(text, unit_names) -> state dict
    costs_of(state), risk_of(state)                  the cost table and risk model a resumed controller is built with

`load_state` refuses, with one ValueError saying what is wrong, anything `dump_state` would not have
written for this model: not JSON, another format or version, a missing, extra or mistyped field, a
non-finite or out-of-range number, or a unit list other than this model's.
"""

from __future__ import annotations

import dataclasses
import json

from hilore_verl.validation import checks
from hilore_verl.planner.costs import CostTable, UnitProfile
from hilore_verl.loss.risk import RiskModel

STATE_FORMAT = "hilore-verl/controller-state"
STATE_VERSION = 6
# read too: version 1 also held the audit's copy of the risk budget (audit_budget); versions 1 and 2 had
# no measured transient (costs.transient_bytes: 0, the table reserves its largest unit, as they planned);
# versions 1 to 3 no weight copies or element sizes per unit (units' fixed_bytes: 0, their unmanaged bytes
# held them; element_size 0: the table's) and
# no head rows (costs.head_rows: 0, the head scaled with the tokens) and one transient for both phases
# (costs.forward_transient_bytes: 0); versions 1 to 4 no head's part of the transients (costs.head_*: 0,
# the layers' figures stood for whole phases) and no codec working memory (costs.codec_transient: 0);
# versions 1 to 5 no base of the forward's head part (costs.head_forward_base_*: 0, its ops' figures hold it)
OLD_VERSIONS = (1, 2, 3, 4, 5)
MAX_STATE_BYTES = 64 * 2**20  # a real state is a few KiB per hundred units
HEAD_TRANSIENTS = ("head_transient", "head_transient_steep", "head_forward_transient", "head_forward_transient_steep",
                   "head_forward_base")


def costs_of(state: dict) -> CostTable:
    """The cost table of a state `load_state` returned."""
    fields = dict(state["costs"])
    fields["units"] = [UnitProfile(**u) for u in fields["units"]]
    fields["formats"] = tuple(fields["formats"])
    return CostTable(**fields)


def risk_of(state: dict) -> RiskModel | None:
    """The risk model of a state `load_state` returned (None: the state had none)."""
    if state["risk"] is None:
        return None
    risk = RiskModel()
    risk.load_state_dict(state["risk"])
    return risk


def dump_state(state: dict) -> str:
    """`Controller.state_dict()` as JSON text, tagged with its format and version. Floats are written
    as their shortest repr, so they load back bit for bit; a non-finite number raises ValueError."""
    try:
        return json.dumps({"format": STATE_FORMAT, "version": STATE_VERSION, "state": state},
                          allow_nan=False, indent=1, sort_keys=True)
    except ValueError as err:
        raise ValueError(f"the controller state holds a non-finite number ({err})") from None


def load_state(text: str | bytes, unit_names: list[str] | None = None) -> dict:
    """Parse and validate what `dump_state` wrote; no code runs (plain JSON). ValueError saying what is
    wrong for anything else: not JSON, another format or version, a missing, extra or mistyped field,
    a non-finite or out-of-range number, or a unit list other than `unit_names` (this model's units)."""
    if len(text) > MAX_STATE_BYTES:
        raise ValueError(f"{len(text)} bytes, more than a controller state takes ({MAX_STATE_BYTES})")

    def no_constants(name):
        raise ValueError(f"non-finite number {name}")

    try:
        doc = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise ValueError("not a controller state: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        raise ValueError(f"not a hilore-verl controller state (no format tag {STATE_FORMAT!r})")
    version = doc.get("version")
    if version not in (STATE_VERSION, *OLD_VERSIONS) or isinstance(version, bool):
        raise ValueError(f"controller state version {version!r}; this hilore-verl reads versions "
                         f"{', '.join(map(str, (*OLD_VERSIONS, STATE_VERSION)))}")
    _keys("", doc, {"format", "version", "state"})
    state = doc["state"]
    fields = {"costs", "risk", "risk_budget", "memory_factor"}
    _keys("state", state, fields | {"audit_budget"} if version == 1 else fields)
    costs = state.get("costs")
    if version in OLD_VERSIONS and isinstance(costs, dict):  # what the older versions did not measure
        if "transient_bytes" not in costs:
            costs.update(transient_bytes=0.0, transient_fixed=0.0, gradients_at_peak=1.0)
        costs.setdefault("forward_transient_bytes", 0.0)  # the backward's figure stands for both
        costs.setdefault("forward_transient_fixed", 0.0)
        costs.setdefault("head_rows", 0)
        for stem in HEAD_TRANSIENTS:
            costs.setdefault(f"{stem}_bytes", 0.0)
            costs.setdefault(f"{stem}_fixed", 0.0)
        costs.setdefault("codec_transient", 0.0)
        costs.setdefault("codec_transient_cap", 0.0)
        for unit in costs.get("units") if isinstance(costs.get("units"), list) else []:
            if isinstance(unit, dict):
                unit.setdefault("fixed_bytes", 0.0)
                unit.setdefault("element_size", 0.0)
    _check_costs(state["costs"], unit_names)
    names = [u["name"] for u in state["costs"]["units"]]
    if state["risk"] is not None:
        _check_risk(state["risk"], names)
    _number("state.risk_budget", state["risk_budget"], lambda v: v >= 0, ">= 0")
    _number("state.memory_factor", state["memory_factor"], lambda v: 0.01 <= v <= 1, "in [0.01, 1]")
    if state.get("audit_budget") is not None:
        _number("state.audit_budget", state["audit_budget"], lambda v: v > 0, "> 0 (or null)")
    state.pop("audit_budget", None)  # version 1: the risk budget's second copy, equal to risk_budget
    return state


def _keys(where: str, value, expected: set) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{where or 'the file'}: expected an object, got {type(value).__name__}")
    missing, extra = sorted(expected - set(value)), sorted(set(value) - expected)
    problems = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unexpected {', '.join(extra)}"] if extra else [])
    if problems:
        raise ValueError(f"{where or 'the file'}: " + "; ".join(problems))


MAX_MAGNITUDE = 1e18  # above any byte count, time or sensitivity a real state holds; sums of them stay finite


def _number(where: str, value, ok=lambda v: True, valid: str = "", integer: bool = False) -> None:
    """checks.number / checks.integer, and no magnitude above MAX_MAGNITUDE (sums of them stay finite)."""
    check = checks.integer if integer else checks.number
    check(where, value, valid, lambda v: abs(float(v)) <= MAX_MAGNITUDE and ok(v))


def _check_costs(costs, unit_names: list[str] | None) -> None:
    from hilore_verl.kernels import FORMATS, GROUP_SIZES

    _keys("state.costs", costs, {f.name for f in dataclasses.fields(CostTable)})
    units = costs["units"]
    if not isinstance(units, list) or not units:
        raise ValueError("state.costs.units: expected a non-empty list")
    for i, unit in enumerate(units):
        where = f"state.costs.units[{i}]"
        _keys(where, unit, {f.name for f in dataclasses.fields(UnitProfile)})
        if not isinstance(unit["name"], str):
            raise ValueError(f"{where}.name: expected a string, got {unit['name']!r}")
        for key in ("saved_bytes", "held_bytes", "forward_s", "fixed_bytes", "element_size"):
            _number(f"{where}.{key}", unit[key], lambda v: v >= 0, ">= 0")
        _number(f"{where}.compressible", unit["compressible"], lambda v: 0 <= v <= 1, "in [0, 1]")
        if not isinstance(unit["replay"], dict) or not all(isinstance(k, str) for k in unit["replay"]):
            raise ValueError(f"{where}.replay: expected an object of byte counts by unit, got {unit['replay']!r}")
        for part, value in unit["replay"].items():
            _number(f"{where}.replay[{part!r}]", value)
    names = [u["name"] for u in units]
    if len(set(names)) != len(names):
        raise ValueError("state.costs.units: a unit is listed twice")
    if unit_names is not None and names != list(unit_names):
        raise ValueError(f"its {len(names)} units ({names[0]} ... {names[-1]}) are not this model's "
                         f"{len(unit_names)} units ({unit_names[0]} ... {unit_names[-1]}): saved for another model")
    _number("state.costs.tokens", costs["tokens"], lambda v: v >= 1, ">= 1", integer=True)
    _number("state.costs.head_rows", costs["head_rows"], lambda v: v >= 0, ">= 0", integer=True)
    _number("state.costs.element_size", costs["element_size"], lambda v: v in (1, 2, 4, 8), "in 1, 2, 4, 8",
            integer=True)
    _number("state.costs.group_size", costs["group_size"], lambda v: v in GROUP_SIZES, f"in {GROUP_SIZES}",
            integer=True)
    _number("state.costs.unmanaged_bytes", costs["unmanaged_bytes"], lambda v: v >= 0, ">= 0")
    for key in ("region_saving_bytes", "runtime_overhead_s", "keep_pass_s", "transient_bytes",
                "forward_transient_bytes", "codec_transient", "codec_transient_cap", *(f"{stem}_bytes" for stem in HEAD_TRANSIENTS)):
        _number(f"state.costs.{key}", costs[key], lambda v: v >= 0, ">= 0")
    for key in ("transient_fixed", "gradients_at_peak", "forward_transient_fixed",
                *(f"{stem}_fixed" for stem in HEAD_TRANSIENTS)):
        _number(f"state.costs.{key}", costs[key], lambda v: 0 <= v <= 1, "in [0, 1]")
    for key in ("codec_bytes_per_s", "host_bytes_per_s"):
        _number(f"state.costs.{key}", costs[key], lambda v: v > 0, "> 0")
    formats = costs["formats"]
    if not isinstance(formats, list) or any(not isinstance(f, str) or f not in FORMATS for f in formats):
        raise ValueError(f"state.costs.formats: expected a list of {', '.join(FORMATS)}, got {formats!r}")
    if len(set(formats)) != len(formats):
        raise ValueError(f"state.costs.formats: a format is listed twice in {formats!r}")
    if not isinstance(costs["offload"], bool):
        raise ValueError(f"state.costs.offload: expected true or false, got {costs['offload']!r}")


def _check_risk(risk, names: list[str]) -> None:
    _keys("state.risk", risk, {"sensitivity", "grad_scale", "log_sum", "count"})
    known = set(names)
    for key, integer, ok, valid in (("sensitivity", False, lambda v: v >= 0, ">= 0"),
                                    ("log_sum", False, lambda v: True, ""),
                                    ("count", True, lambda v: v >= 1, ">= 1")):
        table = risk[key]
        if not isinstance(table, dict):
            raise ValueError(f"state.risk.{key}: expected an object (unit -> number), got {type(table).__name__}")
        for unit, value in table.items():
            if unit not in known:
                raise ValueError(f"state.risk.{key}: {unit!r} is not a unit of the cost table")
            _number(f"state.risk.{key}[{unit!r}]", value, ok, valid, integer=integer)
    if set(risk["log_sum"]) != set(risk["count"]):
        raise ValueError("state.risk: log_sum and count name different units")
    if not set(risk["sensitivity"]) <= set(risk["count"]):
        raise ValueError("state.risk: a sensitivity without a calibration count")
    if risk["grad_scale"] is not None:
        _number("state.risk.grad_scale", risk["grad_scale"], lambda v: v > 0, "> 0 (or null)")


__all__ = ["MAX_STATE_BYTES", "STATE_FORMAT", "STATE_VERSION", "costs_of", "dump_state", "load_state", "risk_of"]
