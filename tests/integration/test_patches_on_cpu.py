"""Every patch in patches/ names its verl version and still applies to the installed verl (dry run
on a copy of the files it touches); the apply script reports it so."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

import verl

from tests.harness import subprocess as harness

PATCHES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))
SITE = Path(verl.__file__).resolve().parents[1]


def test_there_are_patches():
    assert PATCHES


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_names_its_version_and_applies(patch, tmp_path):
    text = patch.read_text()
    version = re.search(r"^verl-version: (\S+)$", text, re.M)
    assert version and version.group(1) == verl.__version__, f"{patch.name} is for verl {version and version.group(1)}"
    for target in re.findall(r"^\+\+\+ b/(\S+)", text, re.M):
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SITE / target, tmp_path / target)
    proc = harness.run(["patch", "-p1", "-d", str(tmp_path), "--forward", "--silent"], input=text, timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for target in re.findall(r"^\+\+\+ b/(\S+)", text, re.M):  # the patched files still compile
        compile((tmp_path / target).read_text(), target, "exec")


def test_apply_script_checks_without_changing_verl():
    before = {p: (SITE / t).read_bytes() for p in PATCHES for t in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M)}
    out = harness.run([str(PATCHES[0].parent / "apply.sh"), "--check", sys.executable], env={**os.environ},
                      timeout_s=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(line.startswith("ok ") for line in out.stdout.strip().splitlines()), out.stdout
    after = {p: (SITE / t).read_bytes() for p in PATCHES for t in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M)}
    assert before == after
