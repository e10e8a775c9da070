"""Handing freed memory back to the operating system.

glibc's allocator keeps freed heap pages for reuse, so a process that tokenized a burst of large
prompts stays at its peak resident size long after; malloc_trim returns what is free, and a
fixed mmap threshold keeps the largest allocations out of the heap altogether."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS; False where that is not available."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
LARGE_ALLOCATION_BYTES = 1 << 20


def map_large_allocations(nbytes: int = LARGE_ALLOCATION_BYTES) -> bool:
    """Serve every allocation of nbytes or more from its own mapping, which free() unmaps at
    once. glibc's default threshold rises to the largest block freed so far (up to 32 MiB), so
    after the first 2 MB prompt its text and id lists come from the heap and the arenas, where
    what surrounds them keeps part of the freed space from ever going back: resident memory crept
    up by a few MiB with each burst of large inputs, trim or not. A fixed threshold stops that
    rise. False where mallopt is not available."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))


class TrimAfterBurst:
    """Trims the heap once a burst of large allocations has passed: soon() after each large
    input (tokenized, or refused for its size: parsing it took memory too) trims quiet_s after
    the last one, and no later than max_wait_s after the first, so that a steady stream of them
    is trimmed too. A full collection comes first: a refused request's prompt ids are held in
    reference cycles (its exception's traceback through gRPC's abort) until one runs. The trim
    runs on a worker thread: on a heap of gigabytes it takes a while. Called on the loop."""

    def __init__(self, quiet_s: float = 0.5, max_wait_s: float = 5.0) -> None:
        self.quiet_s, self.max_wait_s = quiet_s, max_wait_s
        self._first = self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.trims = 0  # how many ran (tests, logs)

    def soon(self) -> None:
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        if self._timer is None:
            self._first = self._last
            self._timer = loop.call_later(self.quiet_s, self._due)

    def _due(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        wait = min(self._last + self.quiet_s, self._first + self.max_wait_s) - now
        if wait > 0:  # another large input came meanwhile: wait for the quiet after it
            self._timer = loop.call_later(wait, self._due)
            return
        self._timer = None
        self.trims += 1
        gc.collect()
        loop.run_in_executor(None, release_free_memory)
