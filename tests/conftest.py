import os

import pytest

# The suite's verl tests (`*_on_cpu.py`) train on CPU ranks over gloo: on a GPU host too they run on
# the plugin's CPU platform, which spawned ranks, subprocesses and Ray workers inherit. Tests of the
# platform choice itself set or clear VERL_PLATFORM on their own.
os.environ.setdefault("VERL_PLATFORM", "cpu")

# One thread per process, forced (not only defaulted): the bitwise comparisons (codecs, gradients against
# stock verl) are made at one thread, and the 2-rank tests run two processes on two cores. Set here for
# this process (torch.set_num_threads below) and, through OMP_NUM_THREADS, for the subprocesses, spawned
# ranks and Ray workers tests start. HILORE_TEST_THREADS=N runs N threads instead (an explicit opt-out;
# the report header then says so).
THREADS_VARIABLE = "HILORE_TEST_THREADS"


def _test_threads() -> int:
    value = os.environ.get(THREADS_VARIABLE, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_VARIABLE}={value!r}: expected a positive number of threads")
    return int(value)


TEST_THREADS = _test_threads()
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)

# The fused CPU codec compiles once per row width and format; tests sweep many widths in many
# processes, so they run the torch reference, which the fused codec equals bit for bit
# (tests/kernels/test_cpu_fused_on_cpu.py checks that, and runs the runtime on the fused codec;
# tests/kernels/test_cpu_codec_path_on_cpu.py that the default entry point runs the compiled codecs).
os.environ.setdefault("HILORE_VERL_CPU_CODEC", "reference")


import torch  # noqa: E402  (after OMP_NUM_THREADS, which OpenMP reads once)

torch.set_num_threads(TEST_THREADS)


def pytest_report_header(config):
    line = f"threads: {TEST_THREADS} (torch.set_num_threads, OMP_NUM_THREADS)"
    if TEST_THREADS > 1:
        line += f" from {THREADS_VARIABLE}: bitwise comparisons are made for one thread"
    return line


# Per-test pytest timeout (pyproject.toml: timeout = 900) against the tests' subprocess timeouts: a child's
# own timeout must fire first, so that the test fails with the child's output and the child is killed
# (tests/harness/subprocess.py `run` kills its whole process group; plain subprocess.run kills the child
# only). The tests below wait on subprocesses for longer than 900 s in all: each gets a pytest timeout of
# that sum plus SUBPROCESS_MARGIN_S for its fixtures and checks. tests/test_subprocess_timeouts_on_cpu.py
# reads every test's subprocess timeouts from its source and fails when one would outlast the pytest timeout.
SUBPROCESS_MARGIN_S = 120
LONG_SUBPROCESS_TESTS = {  # "file name::test function" (any folder of tests/): its subprocess timeouts summed, seconds
    "test_demo_on_cpu.py::test_demo_command": 1200,
    "test_verl_suite_on_cpu.py::test_verl_s_own_cpu_tests_pass_with_the_plugin_loaded": 2400,
    "test_two_nodes_on_cpu.py::test_tiny_recipe_on_two_nodes": 900,
    "test_gpu_check_on_cpu.py::test_the_cpu_rehearsal_runs_every_stage_without_verl": 1320,
    "test_main_ppo_on_cpu.py::test_hilore_epochs_minibatches_dynamic_bsz_kl_audit_then_resume_without_probing": 1800,
    "test_main_ppo_on_cpu.py::test_stock_ppo_trainer_plus_documented_overrides_with_the_shared_prompt": 900,
    "test_main_ppo_on_cpu.py::test_legacy_trainer_starting_without_a_loss_term_calibrates_later": 900,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        waited = LONG_SUBPROCESS_TESTS.get(f"{item.path.name}::{getattr(item, 'originalname', item.name)}")
        if waited is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(waited + SUBPROCESS_MARGIN_S))


def _has_cuda() -> bool:
    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It must be switched on
# before any @triton.jit decorator runs, so here, before test modules import the kernels.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
