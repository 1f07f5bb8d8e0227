"""The `hilore:` section: defaults, hydra containers, and errors that name the key and the valid range."""

import pytest
from omegaconf import OmegaConf

from hilore_verl.training.config import HiLoReConfig
from hilore_verl.planner import BudgetConfig


def test_defaults_and_a_full_section():
    assert HiLoReConfig.from_dict(None) == HiLoReConfig()
    cfg = HiLoReConfig.from_dict({"enable": True, "budget": {"mode": "gib", "value": 40}, "risk_budget": 0.005,
                                  "formats": ["int8"], "group_size": 128, "offload": True, "audit_every": 10})
    assert cfg.enable and cfg.budget == BudgetConfig("gib", 40) and cfg.formats == ("int8",)
    assert cfg.group_size == 128 and cfg.offload and cfg.audit_every == 10


def test_hydra_containers_are_accepted():
    section = OmegaConf.create({"enable": True, "budget": {"mode": "gc_ratio", "value": 1.25},
                                "formats": ["int8", "fp8"]})
    cfg = HiLoReConfig.from_dict(section)
    assert cfg.budget.value == 1.25 and cfg.formats == ("int8", "fp8")


@pytest.mark.parametrize("section, message", [
    ({"enabel": True}, "hilore.enabel: unknown key; valid keys: enable, budget"),
    ({"enable": "yes"}, "hilore.enable: got 'yes'; valid: true or false"),
    ({"risk_budget": -0.1}, r"hilore.risk_budget: got -0.1; valid: a finite number >= 0"),
    ({"group_size": 48}, r"hilore.group_size: got 48; valid: an integer one of \(32, 64, 128\)"),
    ({"formats": ["int8", "int2"]}, "hilore.formats: unknown format 'int2'; valid: int8, fp8, int4"),
    ({"budget": {"mode": "ratio", "value": 1.1}}, "hilore.budget.mode: unknown mode 'ratio'"),
    ({"budget": {"mode": "gib", "value": "big"}}, "hilore.budget.value: got 'big'; valid: a finite number > 0"),
    ({"budget": {"mode": "gib", "valu": 3}}, "hilore.budget.valu: unknown key; valid keys: mode, value"),
    ({"budget": 1.1}, r"hilore.budget: expected \{mode: ..., value: ...\}"),
    ({"audit_every": 2.5}, r"hilore.audit_every: got 2.5; valid: an integer >= 0"),
    ({"audit_tolerance": 1.0}, r"hilore.audit_tolerance: got 1.0; valid: a finite number > 1"),
    ({"min_bytes": True}, r"hilore.min_bytes: got True; valid: an integer >= 0"),
])
def test_bad_sections_name_the_key_and_the_valid_range(section, message):
    with pytest.raises(ValueError, match=message):
        HiLoReConfig.from_dict(section)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("section, message", [
    ({"budget": {"mode": "gib", "value": NAN}}, "hilore.budget.value: got nan; valid: a finite number > 0"),
    ({"budget": {"mode": "gc_ratio", "value": INF}}, "hilore.budget.value: got inf; valid: a finite number >= 1"),
    ({"budget": {"mode": "auto", "value": -INF}}, "hilore.budget.value: got -inf; valid: a finite number >= 0"),
    ({"budget": {"mode": "gib", "value": True}}, "hilore.budget.value: got True; valid: a finite number > 0"),
    ({"risk_budget": INF}, "hilore.risk_budget: got inf; valid: a finite number >= 0"),
    ({"risk_budget": NAN}, "hilore.risk_budget: got nan; valid: a finite number >= 0"),
    ({"risk_budget": "0.01"}, "hilore.risk_budget: got '0.01'; valid: a finite number >= 0"),
    ({"risk_budget": False}, "hilore.risk_budget: got False"),
    ({"audit_tolerance": NAN}, "hilore.audit_tolerance: got nan; valid: a finite number > 1"),
    ({"audit_tolerance": INF}, "hilore.audit_tolerance: got inf"),
    ({"formats": {"int8": 1}}, "hilore.formats: expected a list of formats, some of int8, fp8, int4; got dict"),
    ({"formats": 5}, "hilore.formats: expected a list of formats.*got int 5"),
    ({"formats": []}, r"hilore.formats: empty; list at least one of int8, fp8, int4 \(to forbid compression, set "
                      r"risk_budget: 0\)"),
    ({"formats": ["int8", "fp8", "int8"]}, "hilore.formats: 'int8' is listed twice"),
    ({"formats": [8]}, "hilore.formats: unknown format 8"),
    ({"group_size": 64.0}, "hilore.group_size: got 64.0; valid: an integer"),
    ({"seed": 1.5}, "hilore.seed: got 1.5; valid: an integer"),
])
def test_non_finite_and_mistyped_values_name_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        HiLoReConfig.from_dict(section)


@pytest.mark.parametrize("section", ["", 0, False, [], "enable", 1, ["enable"]])
def test_a_section_that_is_not_a_mapping_is_refused(section):
    with pytest.raises(ValueError, match=r"hilore: expected a mapping of settings \(or null for the defaults\), got "):
        HiLoReConfig.from_dict(section)


def test_empty_mappings_and_ints_for_float_keys_are_fine():
    assert HiLoReConfig.from_dict({}) == HiLoReConfig() == HiLoReConfig.from_dict(OmegaConf.create({}))
    cfg = HiLoReConfig.from_dict({"risk_budget": 0, "audit_tolerance": 3, "budget": {"mode": "auto", "value": 0},
                                  "formats": "fp8"})
    assert cfg.risk_budget == 0 and cfg.audit_tolerance == 3 and cfg.formats == ("fp8",)


@pytest.mark.parametrize("kwargs, message", [
    ({"risk_budget": INF}, "hilore.risk_budget: got inf"),
    ({"audit_tolerance": NAN}, "hilore.audit_tolerance: got nan"),
    ({"formats": ("int8", "int3")}, "hilore.formats: unknown format 'int3'"),
    ({"formats": ("int8", "int8")}, "hilore.formats: 'int8' is listed twice"),
    ({"formats": ()}, "hilore.formats: empty"),
    ({"formats": {"int8": 1}}, "hilore.formats: expected a list of formats"),
    ({"budget": {"mode": "gib", "value": NAN}}, "hilore.budget.value: got nan; valid: a finite number > 0"),
    ({"budget": 40}, r"hilore.budget: expected \{mode: ..., value: ...\}"),
    ({"group_size": 64.0}, "hilore.group_size: got 64.0"),
    ({"enable": 1}, "hilore.enable: got 1; valid: true or false"),
])
def test_direct_construction_is_checked_too(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiLoReConfig(**kwargs)
    assert HiLoReConfig(formats=["int4", "int8"]).formats == ("int4", "int8")


@pytest.mark.parametrize("mode, value", [("gib", NAN), ("gc_ratio", INF), ("auto", INF), ("auto", -1), ("gib", 0)])
def test_budget_config_rejects_non_finite_and_out_of_range_values(mode, value):
    with pytest.raises(ValueError, match="budget.value: got .*; valid: a finite number"):
        BudgetConfig(mode, value)


def test_a_null_budget_value_is_the_modes_default_and_required_where_there_is_none():
    """The recipes write `value: null`: gc_ratio reads it as its 1.10; gib and auto (a number of GiB) ask for
    one, so overriding only the mode cannot read a ratio as GiB."""
    assert HiLoReConfig.from_dict({"budget": {"mode": "gc_ratio", "value": None}}).budget == BudgetConfig("gc_ratio", 1.10)
    for mode in ("auto", "gib"):
        with pytest.raises(ValueError, match=f"hilore.budget.value: required with mode {mode}"):
            HiLoReConfig.from_dict({"budget": {"mode": mode, "value": None}})
    assert HiLoReConfig.from_dict({"budget": {"mode": "auto", "value": 2}}).budget == BudgetConfig("auto", 2)


def test_every_key_is_documented_in_config_md():
    import dataclasses
    import pathlib

    from hilore_verl.training.config import HiLoReConfig

    text = (pathlib.Path(__file__).parent.parent.parent / "docs" / "config.md").read_text()
    keys = [f.name for f in dataclasses.fields(HiLoReConfig) if f.name != "budget"] + ["budget.mode", "budget.value"]
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, f"docs/config.md has no row for: {missing}"


@pytest.mark.parametrize("section, message", [
    ({"risk_budget": 10**400}, "hilore.risk_budget"),
    ({"audit_tolerance": 10**400}, "hilore.audit_tolerance"),
    ({"budget": {"mode": "gib", "value": 10**400}}, "finite"),
    ({"budget": {"mode": "gc_ratio", "value": 0.5}}, "below what full recompute needs"),
    ({"budget": {"mode": "auto"}}, "hilore.budget.value: required with mode auto"),
    ({"budget": {"mode": "gib"}}, "hilore.budget.value: required with mode gib"),
    ({"oom_retries": 11}, "hilore.oom_retries"),
    ({"fault_timeout_s": 0}, "hilore.fault_timeout_s"),
    ({"fault_timeout_s": float("inf")}, "hilore.fault_timeout_s"),
    ({"step_snapshot": "yes"}, "hilore.step_snapshot"),
])
def test_values_that_could_never_work_are_refused_at_start_up(section, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        HiLoReConfig.from_dict(section)


def test_unit_plan_group_size_is_checked_in_every_mode():
    from hilore_verl.runtime.plan import UnitPlan

    for mode in ("keep", "recompute", "compress"):
        with pytest.raises(ValueError, match="group_size"):
            UnitPlan(mode, fmt="int8" if mode == "compress" else None, group_size=7)


def test_every_key_of_the_section_is_checked_by_one_rule():
    """A new key cannot skip validation: bools by their type, every number by its entry in RANGES."""
    import dataclasses

    from hilore_verl.training.config import RANGES, HiLoReConfig

    keys = {f.name for f in dataclasses.fields(HiLoReConfig)}
    flags = {f.name for f in dataclasses.fields(HiLoReConfig) if f.type == "bool"}
    assert keys - flags - {"budget", "formats"} == set(RANGES)
    for key in flags:
        with pytest.raises(ValueError, match=rf"hilore.{key}: got 'yes'; valid: true or false"):
            HiLoReConfig.from_dict({key: "yes"})
    for key, (kind, _, _) in RANGES.items():
        for bad in (float("nan"), "1", True, 1.5 if kind.__name__ == "integer" else 10**400):
            with pytest.raises(ValueError, match=rf"hilore.{key}: got .*; valid: (a finite number|an integer)"):
                HiLoReConfig.from_dict({key: bad})


def test_the_runtime_settings_derive_from_the_section():
    from hilore_verl.runtime import RuntimeConfig

    config = HiLoReConfig.from_dict({"min_bytes": 4096, "seed": -7})
    assert config.runtime_config() == RuntimeConfig(min_bytes=4096, seed=-7)
    assert HiLoReConfig().runtime_config() == RuntimeConfig()  # the same defaults in both


def test_every_command_line_option_is_documented_in_its_config_md_section():
    """Each subcommand's flags (the parser itself, not a list kept beside it) against the rows of its
    `## hilore-verl <command> options` section; doctor takes no option worth a table."""
    import argparse
    import pathlib
    import re

    from hilore_verl.cli import build_parser

    text = (pathlib.Path(__file__).parent.parent.parent / "docs" / "config.md").read_text()
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = {}
    for command, parser in subparsers.choices.items():
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
        match = re.search(rf"^## `hilore-verl {command}` options\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        if not flags:
            continue
        assert match, f"docs/config.md has no section for hilore-verl {command}"
        absent = [f for f in flags if f"`{f}`" not in match.group(1)]
        if absent:
            missing[command] = absent
    assert not missing, f"options without a row in their docs/config.md section: {missing}"
