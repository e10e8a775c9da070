"""Shared test setup.

Triton kernels run under the CPU interpreter when there is no GPU. TRITON_INTERPRET must be set
before any module defining a @triton.jit kernel is imported (triton.jit picks interpreter or
compiler at decoration time), so it is set here, in the first conftest pytest loads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # plain `pytest` does not put the repo root on sys.path
    sys.path.insert(0, _ROOT)

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from pagedserve.kernels._interpreter import fix_interpreter_index  # noqa: E402

fix_interpreter_index()


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tests share 2 cores with server processes


@pytest.fixture(scope="session")
def model_dir():
    from pagedserve.core.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
