import os

# The suite's verl tests (`*_on_cpu.py`) train on CPU ranks over gloo: on a GPU host too they run on
# the plugin's CPU platform, which spawned ranks, subprocesses and Ray workers inherit. Tests of the
# platform choice itself set or clear VERL_PLATFORM on their own.
os.environ.setdefault("VERL_PLATFORM", "cpu")

# One OpenMP thread per process: the 2-rank tests run two processes on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The fused CPU codec compiles once per row width and format; tests sweep many widths in many
# processes, so they run the torch reference, which the fused codec equals bit for bit
# (tests/test_cpu_fused_on_cpu.py checks that, and runs the runtime on the fused codec).
os.environ.setdefault("HILORE_VERL_CPU_CODEC", "reference")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It must be switched on
# before any @triton.jit decorator runs, so here, before test modules import the kernels.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
