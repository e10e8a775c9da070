"""Result records shared by every benchmark (schema: ../shared/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = os.environ.get("PAGEDSERVE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=RESULTS.parent).stdout.strip()  # the device machine gets no .git: pass it in
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"commit": commit, "gpu": gpu, "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "triton": triton_version,
            "command": " ".join([Path(sys.executable).name, *sys.argv])}


def write_records(name: str, records: list[dict]) -> Path:
    """One new file per run, so the history shows the progress."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}_{time.strftime('%Y-%m-%dT%H%M%S')}.jsonl"
    env = environment()
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps({**env, **r}) + "\n")
    return path
