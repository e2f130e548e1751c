"""Shared test set-up: GPU tests are marked and skipped cleanly; CUDA is never initialised at collection."""

import pytest


def _cuda_count():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_runtest_setup(item):
    if item.get_closest_marker("multi_gpu") and _cuda_count() < 2:
        pytest.skip("needs two or more CUDA GPUs")
    if item.get_closest_marker("gpu") and _cuda_count() < 1:
        pytest.skip("needs a CUDA GPU")
