"""Progress lines for the slow start phases (conversion, loading, profiling, warm-up, graph
capture): one line when a phase starts and one with its duration when it ends, through the
`pagedserve.progress` logger, so they reach stderr with the process's other log lines and a
silent minute of start-up always has a line saying what it is doing."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("pagedserve.progress")


@contextmanager
def phase(what: str) -> Iterator[None]:
    log.info("%s ...", what)
    start = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)
