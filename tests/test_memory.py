"""pagedserve.core.memory gives freed heap back to the OS (glibc)."""

import gc
import os
import sys

import pytest

from pagedserve.core.memory import release_free_memory


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_allocations_go_back_after_a_trim():
    gc.collect()
    release_free_memory()  # what earlier tests freed: the burst below must take new pages
    before = rss_mib()
    # 600-byte objects come from glibc (pymalloc serves up to 512 and frees its own arenas)
    burst = [bytes(600) + i.to_bytes(4, "little") for i in range(80_000)]  # ~50 MiB
    grown = rss_mib()
    del burst
    gc.collect()
    assert rss_mib() - before > 40  # freed, but still held by the allocator
    assert release_free_memory()
    assert grown - before > 40
    assert rss_mib() - before < (grown - before) / 2
