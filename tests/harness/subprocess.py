"""Run a command or Python code in a fresh process of this environment, in a session of its own.

    proc = run([cli, "demo"], timeout_s=600)          # subprocess.CompletedProcess, text output captured
    proc = run_python("import verl", env={...})       # python -c CODE with one OpenMP thread

The child is started with `start_new_session=True`, so it leads a process group of its own. If the wait
ends early (the timeout, or anything raised meanwhile, such as pytest-timeout's failure of the test or a
KeyboardInterrupt), the whole group is killed (SIGKILL), so nothing the child started (spawned ranks, Ray's
raylet and workers, a pytest run's own subprocesses) stays behind. `timeout_s` must stay below the test's
pytest timeout (pyproject.toml `timeout`, or the test's own `timeout` mark): otherwise pytest-timeout fails
the test first, and only the group kill here cleans up after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s process group (its session, see `run`); only while `proc` is not yet reaped, so the
    group id cannot belong to another process."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None, cwd=None,
        input: str | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)`, with the child's whole
    process group killed when the wait ends early; raises subprocess.TimeoutExpired after `timeout_s`."""
    with subprocess.Popen(list(cmd), stdin=subprocess.PIPE if input is not None else None, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            try:  # what it wrote before the kill, for the message (a process outside the group may hold the pipes)
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                stdout = stderr = None
            raise subprocess.TimeoutExpired(proc.args, timeout_s, output=stdout, stderr=stderr) from None
        except BaseException:
            kill_group(proc)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_python(code: str, env: dict[str, str] | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return run([sys.executable, "-c", code], timeout_s=timeout_s, env=full_env)
