"""Subprocess timeouts against the per-test pytest timeout, and the process-group kill of tests/harness/subprocess.py.

A test whose subprocesses may together run longer than its pytest timeout is failed by pytest-timeout
while a child still runs: the child's own timeout never fires, and whatever the child started (spawned
ranks, Ray) can stay behind. Read from the sources: every test's subprocess timeouts (`timeout=` literals,
tests/harness/subprocess.py's `run` / `run_python`, and this file's helpers with a `timeout` default, once
per call) must sum, with tests/conftest.py's margin, to at most the test's pytest timeout (pyproject.toml's,
or tests/conftest.py's LONG_SUBPROCESS_TESTS for the long ones). A call in a loop counts once.
"""

import ast
import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import conftest
from tests.harness import subprocess as harness

TESTS = Path(__file__).resolve().parent
HARNESS_DEFAULTS = {"run_python": inspect.signature(harness.run_python).parameters["timeout_s"].default}


def _number(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) else None


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _helper_defaults(tree: ast.Module) -> dict[str, float]:
    """Module-level functions with a numeric `timeout` / `timeout_s` default (e.g. main_ppo's)."""
    found = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            args = fn.args.args[len(fn.args.args) - len(fn.args.defaults):] + fn.args.kwonlyargs
            defaults = fn.args.defaults + fn.args.kw_defaults
            for arg, default in zip(args, defaults):
                if arg.arg in ("timeout", "timeout_s") and default is not None and _number(default) is not None:
                    found[fn.name] = _number(default)
    return found


def _subprocess_seconds(test: ast.FunctionDef, helpers: dict[str, float]) -> float:
    total = 0.0
    for call in (n for n in ast.walk(test) if isinstance(n, ast.Call)):
        name = _called_name(call)
        keywords = {k.arg: k.value for k in call.keywords}
        if "timeout" in keywords and _number(keywords["timeout"]) is not None:
            total += _number(keywords["timeout"])
        elif name in ("run", "run_python", *helpers) and "timeout_s" in keywords \
                and _number(keywords["timeout_s"]) is not None:
            total += _number(keywords["timeout_s"])
        elif name in helpers or name in HARNESS_DEFAULTS:
            total += helpers.get(name, HARNESS_DEFAULTS.get(name))
    return total


def _explicit_timeout(test: ast.FunctionDef) -> float | None:
    for deco in test.decorator_list:
        if isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.func.attr == "timeout":
            return _number(deco.args[0]) if deco.args else None
    return None


def _tests_and_their_subprocess_seconds():
    for path in sorted(TESTS.rglob("test_*.py")):  # tests/ and its package folders (tests/runtime, ...)
        tree = ast.parse(path.read_text())
        helpers = _helper_defaults(tree)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                yield f"{path.name}::{node.name}", _subprocess_seconds(node, helpers), _explicit_timeout(node)


def test_every_subprocess_timeout_ends_before_the_test_s_pytest_timeout(request):
    ini = float(request.config.getini("timeout") or 0)
    assert ini > 0, "pyproject.toml [tool.pytest.ini_options] sets no per-test timeout"
    seen, late = set(), []
    for key, waited, explicit in _tests_and_their_subprocess_seconds():
        seen.add(key)
        listed = conftest.LONG_SUBPROCESS_TESTS.get(key)
        limit = explicit or (listed + conftest.SUBPROCESS_MARGIN_S if listed is not None else ini)
        if waited + conftest.SUBPROCESS_MARGIN_S > limit or (listed is not None and listed < waited):
            late.append(f"{key}: subprocesses may run {waited:.0f} s, pytest timeout {limit:.0f} s")
    assert not late, ("add these to tests/conftest.py LONG_SUBPROCESS_TESTS with the sum of their subprocess "
                      "timeouts, or shorten those:\n" + "\n".join(late))
    assert not set(conftest.LONG_SUBPROCESS_TESTS) - seen, set(conftest.LONG_SUBPROCESS_TESTS) - seen  # stale names


PROBE = """
import os

def pytest_collection_finish(session):
    with open(os.environ["TIMEOUT_MARKS"], "w") as f:
        for item in session.items:
            mark = item.get_closest_marker("timeout")
            f.write(f"{item.nodeid} {mark.args[0] if mark else None}\\n")
"""


def test_the_long_tests_get_their_pytest_timeout(tmp_path):
    """tests/conftest.py's hook marks the listed tests: their files collected in a subprocess (nothing run)."""
    (tmp_path / "timeout_marks_probe.py").write_text(PROBE)
    marks = tmp_path / "marks.txt"
    names = {key.split("::")[0] for key in conftest.LONG_SUBPROCESS_TESTS}
    files = sorted(str(path.relative_to(TESTS.parent)) for path in TESTS.rglob("test_*.py") if path.name in names)
    assert {Path(f).name for f in files} == names, names - {Path(f).name for f in files}
    env = {**os.environ, "TIMEOUT_MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = harness.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "timeout_marks_probe", *files], timeout_s=300, env=env,
                       cwd=str(TESTS.parent))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {}
    for line in marks.read_text().splitlines():
        nodeid, timeout = line.rsplit(" ", 1)
        found.setdefault(nodeid.split("/")[-1].split("[")[0], set()).add(timeout)
    for key, waited in conftest.LONG_SUBPROCESS_TESTS.items():
        assert found.get(key) == {str(waited + conftest.SUBPROCESS_MARGIN_S)}, (key, found.get(key))
    assert found["test_demo_on_cpu.py::test_demo_bad_arm"] == {"None"}  # the others keep pyproject's


def _sleeper_tree(marker: Path) -> str:
    """Python code: a child in the same group that writes its pid to `marker`, then sleeps."""
    return textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(marker)!r}, "w").write(str(child.pid))
        time.sleep(600)
    """)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"  # a zombie is gone but for its exit status
    except FileNotFoundError:
        return False


def _wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.05)


def test_a_timed_out_subprocess_is_killed_with_what_it_started(tmp_path):
    marker = tmp_path / "grandchild.pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        harness.run([sys.executable, "-c", _sleeper_tree(marker)], timeout_s=5)
    assert time.monotonic() - started < 30
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), f"the grandchild {grandchild} outlived the timeout"


def test_an_interrupted_wait_kills_the_group_too(tmp_path, monkeypatch):
    """What pytest-timeout's failure (raised in the waiting thread) does to `run`."""
    marker = tmp_path / "grandchild.pid"
    real = subprocess.Popen.communicate

    def interrupted(self, input=None, timeout=None):
        _wait_for(marker)
        raise KeyboardInterrupt("injected: the test's timeout")

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        harness.run([sys.executable, "-c", _sleeper_tree(marker)], timeout_s=300)
    monkeypatch.setattr(subprocess.Popen, "communicate", real)
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_run_returns_what_subprocess_run_returns():
    proc = harness.run([sys.executable, "-c", "import sys; print(sys.stdin.read().upper()); sys.exit(3)"],
                       timeout_s=60, input="abc", env={**os.environ, "X": "1"})
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "ABC\n", "")
