"""Shared fixtures; the plain helpers behind them live in tests/harness.py."""
import pytest
import torch

import harness
from emu_hooks import pytest_generate_tests, pytest_sessionfinish, suite_schedule  # noqa: F401 - the emulation tests' hooks


@pytest.fixture(params=harness.DEVICES)
def device(request) -> str:
    """Each test that takes ``device`` runs on the CPU, and on CUDA when a GPU is present."""
    return request.param


@pytest.fixture(params=harness.DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh CPU generator with a fixed seed."""
    return torch.Generator().manual_seed(0)
