"""Handing freed memory back to the operating system.

glibc's allocator keeps freed heap pages for reuse, so a process that tokenized a burst of large
prompts stays at its peak resident size long after; malloc_trim returns what is free."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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
