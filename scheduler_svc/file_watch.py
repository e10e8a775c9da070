"""Noticing that files changed: certificate files rotated in place (the API ports' TLS,
api/tls.py, and the engine core's /metrics)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from pathlib import Path


def file_stamp(paths: Iterable[Path]) -> tuple[int, ...]:
    """The files' modification times (0 for one missing): it changes when any is rewritten."""
    return tuple(os.stat(p).st_mtime_ns if p.exists() else 0 for p in paths)


async def watch_files(paths: list[Path], on_change: Callable[[], None],
                      period_s: float = 5.0) -> None:
    """Call on_change whenever one of the files changes, checked every period_s (runs until
    cancelled)."""
    seen = file_stamp(paths)
    while True:
        await asyncio.sleep(period_s)
        if (now := file_stamp(paths)) != seen:
            seen = now
            on_change()
