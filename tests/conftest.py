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

import triton.runtime.interpreter as _interp  # noqa: E402


def _fix_interpreter_index() -> None:
    # Triton 3.6's interpreter holds scalars as shape-(1,) arrays and converts them with int(),
    # which numpy >= 2.4 rejects, so `range(runtime_bound)` fails inside kernels. Convert via
    # the single element instead.
    orig = _interp._patch_lang_tensor
    if getattr(orig, "_pagedserve_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedserve_fixed = True
    _interp._patch_lang_tensor = patched


_fix_interpreter_index()


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tests share 2 cores with server processes


@pytest.fixture(scope="session")
def model_dir():
    from pagedserve.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
