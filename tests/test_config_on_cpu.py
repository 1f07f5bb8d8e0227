"""The `hilore:` section: defaults, hydra containers, and errors that name the key and the valid range."""

import pytest
from omegaconf import OmegaConf

from hilore_verl.config import HiLoReConfig
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
    ({"enable": "yes"}, "hilore.enable: expected bool, got 'yes'"),
    ({"risk_budget": -0.1}, r"hilore.risk_budget: got -0.1; valid: a number >= 0"),
    ({"group_size": 48}, r"hilore.group_size: got 48; valid: an integer one of \(32, 64, 128\)"),
    ({"formats": ["int8", "int2"]}, "hilore.formats: unknown format 'int2'; valid: int8, fp8, int4"),
    ({"budget": {"mode": "ratio", "value": 1.1}}, "hilore.budget: unknown budget mode 'ratio'"),
    ({"budget": {"mode": "gib", "value": "big"}}, "hilore.budget: budget value must be a number"),
    ({"budget": {"mode": "gib", "valu": 3}}, "hilore.budget.valu: unknown key; valid keys: mode, value"),
    ({"budget": 1.1}, r"hilore.budget: expected \{mode: ..., value: ...\}"),
    ({"audit_every": 2.5}, r"hilore.audit_every: got 2.5; valid: an integer >= 0"),
    ({"audit_tolerance": 1.0}, r"hilore.audit_tolerance: got 1.0; valid: a number > 1"),
    ({"min_bytes": True}, r"hilore.min_bytes: got True; valid: an integer >= 0"),
])
def test_bad_sections_name_the_key_and_the_valid_range(section, message):
    with pytest.raises(ValueError, match=message):
        HiLoReConfig.from_dict(section)
