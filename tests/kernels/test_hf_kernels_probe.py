"""HF's PyPI package `kernels` is probed for by transformers; ours lives under `pagedserve.`, so
an installed pagedserve adds no top-level `kernels` (nor `protos`, `scheduler_svc`, ...) and
the probe keeps answering False."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

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
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: what site-packages offers
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True,
                                text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
