"""A child process under a time limit that takes its own children with it when it is stopped.

A stage process starts a process per model row, and Inductor starts compile workers: `subprocess.run`'s
timeout kills only the direct child, and the rest would hold the GPU's memory while the next stage runs.
Each child here leads a session of its own, and a timeout kills the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess


def run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`, the process group killed on
    timeout; raises `subprocess.TimeoutExpired` with what the process wrote before it was stopped."""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc)  # anything the child left running in its group
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
