"""GPU tests compare CUDA runs bit for bit, which needs torch's deterministic algorithms (SDPA's flash
and memory-efficient backward otherwise accumulate with atomics, cuBLAS may pick split reductions).

cuBLAS reads its workspace setting when CUDA starts: it is set here, as pytest collects this folder,
before any test runs (a value set by the caller is kept)."""

import os
from contextlib import contextmanager

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) and cuDNN's deterministic choice inside; the settings as
    they were after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


@pytest.fixture
def deterministic():
    """The whole test (reference and runtime runs alike) under deterministic algorithms."""
    with deterministic_algorithms():
        yield
