"""The GPU tests' deterministic mode (conftest.py): on inside, the caller's settings back after."""

import os

import torch

from tests.gpu.conftest import deterministic_algorithms


def test_deterministic_algorithms_are_on_inside_and_restored_after():
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")  # set as pytest collected the folder
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = True
    try:
        with deterministic_algorithms():
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.is_deterministic_algorithms_warn_only_enabled() and torch.backends.cudnn.benchmark
        try:
            with deterministic_algorithms():
                raise KeyError("a failing test")
        except KeyError:
            pass
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]
