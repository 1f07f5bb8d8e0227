"""verl's own CPU test suite (its `*_on_cpu.py` files, from the sdist of the installed release)
passes in this project's environment, with hilore-verl's plugin loaded in the run."""

import json
import os
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.harness import subprocess as harness
from tests.harness.verl_suite import installed_verl, prepare

ROOT = Path(__file__).resolve().parents[2]
SUITE = Path(os.environ.get("HILORE_VERL_SUITE", ROOT / ".verl_suite"))


@pytest.mark.slow
def test_verl_s_own_cpu_tests_pass_with_the_plugin_loaded(tmp_path):
    if not (SUITE / "tests").is_dir():
        pytest.fail(f"verl's tests are not in {SUITE}: `make install` fetches them "
                    f"(python -m tests.harness.verl_suite fetch {SUITE})")
    version, package = installed_verl()
    assert (SUITE / "VERSION").read_text().strip() == version, "verl's tests are of another release: make install"
    files = prepare(SUITE)
    assert len(files) >= 20, files
    report = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HILORE_SUITE_REPORT": str(report),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "verl_suite"), os.environ.get("PYTHONPATH", "")])}
    proc = harness.run([sys.executable, "-m", "pytest", "-q", "-c", str(SUITE / "pytest.ini"), "--rootdir",
                        str(SUITE), "-p", "hilore_suite_check", *files], cwd=SUITE, env=env, timeout_s=2400)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    print(tail.strip().splitlines()[-1])  # the suite's summary line
    found = json.loads(report.read_text())
    assert found["loaded"] and found["error"] is None, found
    assert "cpu:ray-resources" in found["registered"], found
    # the installed verl was tested (through the link to it), not a copy
    assert Path(found["verl_file"]).is_relative_to(Path(sysconfig.get_paths()["purelib"]).resolve()), found
