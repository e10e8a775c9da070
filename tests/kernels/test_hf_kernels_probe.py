"""Our top-level package `kernels` shares its name with HF's PyPI `kernels`, which transformers
probes for. The probe must keep answering False with ours importable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("kernels")
assert spec is not None and pathlib.Path(spec.origin).parent == pathlib.Path(sys.argv[1]), spec
from transformers.utils.import_utils import is_kernels_available
assert is_kernels_available() is False
import kernels
assert not hasattr(kernels, "__version__")
print("ok")
"""


def test_transformers_does_not_mistake_our_package_for_hf_kernels():
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "kernels")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
