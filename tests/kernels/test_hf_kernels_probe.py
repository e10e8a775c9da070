"""Hugging Face's PyPI package `kernels` is probed for, and imported, by transformers (>= 5.25
requires it). Ours lives under `pagedserve.`: installed, pagedserve adds no top-level `kernels`
(nor `protos`, `scheduler_svc`, ...); run from the checkout's root, where our folder is on
sys.path as `kernels`, the top-level name still reaches HF's package."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = str(ROOT / "kernels")
PROBE = """
import importlib.util, importlib.metadata, os, sys
import pagedserve.kernels
ours = os.path.dirname(os.path.abspath(pagedserve.kernels.__file__))
for name in ("protos", "scheduler_svc", "executor_svc"):
    spec = importlib.util.find_spec(name)
    assert spec is None or {checkout}, name
try:
    importlib.metadata.version("kernels")
    hf = True
except importlib.metadata.PackageNotFoundError:
    hf = False
import kernels
assert (kernels is pagedserve.kernels) is False
if hf:  # the top-level name is HF's package, whatever sys.path holds
    assert not os.path.abspath(kernels.__file__).startswith(ours), kernels.__file__
    assert hasattr(kernels, "CUDAProperties")
from transformers import AutoModelForCausalLM  # imports transformers' hub_kernels
print("ok", hf)
"""


def _probe(cwd: str, path: list[str], checkout: bool) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = PROBE.format(checkout="True" if checkout else "False")
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def _without_checkout() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT]


def test_installed_package_adds_no_generic_top_level_names():
    pytest.importorskip("transformers")
    # run outside the checkout, with the checkout off the path: only what is installed counts
    # (an install by --target, as on the GPU machine, stays on PYTHONPATH)
    with tempfile.TemporaryDirectory() as cwd:
        assert _probe(cwd, _without_checkout(), checkout=False).startswith("ok")


def test_checkout_root_on_path_leaves_hf_kernels_reachable():
    pytest.importorskip("transformers")
    # `python -m pytest` from the root puts the root first on sys.path, as does tests/conftest.py
    assert _probe(str(ROOT), [str(ROOT), *_without_checkout()], checkout=True).startswith("ok")
