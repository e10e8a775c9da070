"""What a service process tells `serve`'s supervisor (pagedserve/supervise.py) about its start:
that it is done (a file the supervisor names), or, by its exit code, that its settings cannot
work and a restart cannot help. Here, below both services, so they need not import the CLI."""

from __future__ import annotations

import os
from pathlib import Path

EXIT_CONFIG = 78  # sysexits' EX_CONFIG: the child's settings cannot work; restarting cannot help
READY_ENV = "PAGEDSERVE_SUPERVISOR_READY_FILE"  # where a child marks its start-up done


def mark_ready() -> None:
    """Tell serve's supervisor that this child's start-up is done (no-op when unsupervised)."""
    if path := os.environ.get(READY_ENV):
        Path(path).touch()
