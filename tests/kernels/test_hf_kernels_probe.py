"""HF's PyPI package `kernels` is probed for by transformers; ours lives under `pagedserve.`, so
an installed pagedserve adds no top-level `kernels` (nor `protos`, `scheduler_svc`, ...) and
the probe keeps answering False."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import importlib.util
for name in ("kernels", "protos", "scheduler_svc", "executor_svc"):
    assert importlib.util.find_spec(name) is None, name
import pagedserve.kernels
from transformers.utils.import_utils import is_kernels_available
assert is_kernels_available() is False
print("ok")
"""


def test_installed_package_adds_no_generic_top_level_names():
    pytest.importorskip("transformers")
    # run outside the checkout, with the checkout off the path: only what is installed counts
    # (an install by --target, as on the GPU machine, stays on PYTHONPATH)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT]
    with tempfile.TemporaryDirectory() as cwd:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        result = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True,
                                text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
