"""Supported-version checks: clear errors naming the ranges, and pyproject stating the same ranges."""

import pathlib
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from hilore_verl.validation.versions import SUPPORTED, UnsupportedVersionError, require_supported_versions, version_problems
from tests.harness.subprocess import run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_installed_versions_are_supported():
    assert version_problems() == []


@pytest.mark.parametrize("found, bad", [
    ({"verl": "0.8.0", "torch": "2.13.0+cpu"}, "verl"),
    ({"verl": "0.10.0", "torch": "2.13.0"}, "verl"),
    ({"verl": "0.9.1", "torch": "2.9.1"}, "torch"),
    ({"verl": "0.9.1", "torch": "2.14.0"}, "torch"),
    ({"verl": None, "torch": "2.13.0"}, "verl"),
])
def test_unsupported_versions_are_named_with_the_range(found, bad):
    with pytest.raises(UnsupportedVersionError) as err:
        require_supported_versions(found)
    message = str(err.value)
    assert f"{bad}{SUPPORTED[bad]}" in message
    assert ("not installed" if found[bad] is None else f"{found[bad]} is installed") in message


def test_local_and_prerelease_builds_count_by_release_number():
    assert version_problems({"verl": "0.9.2.dev0", "torch": "2.11.0a0+git1234"}) == []


def test_pyproject_declares_the_supported_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    for package, spec in SUPPORTED.items():
        assert declared[package] == SpecifierSet(spec), package


def test_importing_the_integration_with_unsupported_verl_fails_at_import():
    code = ("import hilore_verl.validation.versions as v\n"
            "v.installed_version = lambda p: '0.8.2' if p == 'verl' else v.metadata.version(p)\n"
            "import hilore_verl.integration\n")
    proc = run_python(code)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()
    assert any(line.startswith("hilore_verl.validation.versions.UnsupportedVersionError") for line in last)
    assert "verl: 0.8.2 is installed; hilore-verl supports verl>=0.9.1,<0.10" in proc.stderr
