"""Fixtures of the kernel tests (the interpreter setup lives in tests/conftest.py)."""

import pytest
import torch

CUDA = torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if CUDA else "cpu")
