"""The suite runs one thread per process (tests/conftest.py): the bitwise comparisons are made at one thread.
Forced, not defaulted: OMP_NUM_THREADS from the calling shell does not change it; HILORE_TEST_THREADS=N does."""

import os
import sys

import pytest
import torch

from tests import conftest
from tests.harness.subprocess import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import os, sys; sys.path.insert(0, sys.argv[1]); import torch; import tests.conftest; "
         "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")


def test_this_process_runs_the_suite_s_thread_count():
    expected = int(os.environ.get(conftest.THREADS_VARIABLE, "1"))
    assert torch.get_num_threads() == expected == conftest.TEST_THREADS
    assert os.environ["OMP_NUM_THREADS"] == str(expected)  # what subprocesses and spawned ranks inherit


@pytest.mark.parametrize("env, printed", [({"OMP_NUM_THREADS": "4"}, "1 1"),
                                          ({"OMP_NUM_THREADS": "4", "HILORE_TEST_THREADS": "2"}, "2 2")])
def test_conftest_forces_the_thread_count(env, printed):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", conftest.THREADS_VARIABLE)}
    proc = run([sys.executable, "-c", PROBE, ROOT], timeout_s=120, env={**base, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == printed


def test_a_bad_thread_count_is_refused():
    base = {k: v for k, v in os.environ.items() if k != conftest.THREADS_VARIABLE}
    proc = run([sys.executable, "-c", PROBE, ROOT], timeout_s=120, env={**base, conftest.THREADS_VARIABLE: "all"})
    assert proc.returncode != 0 and "HILORE_TEST_THREADS='all': expected a positive number" in proc.stderr
