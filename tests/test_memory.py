"""pagedserve.core.memory gives freed heap back to the OS (glibc)."""

import gc
import os
import subprocess
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


HEAP_AFTER_LARGE_BLOCKS = """
import os, sys
from pagedserve.core.memory import map_large_allocations
if sys.argv[1] == "mapped":
    assert map_large_allocations()
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
x = b"x" * (8 << 20)
del x  # glibc's threshold rises to the largest mapped block freed: 8 MiB
before, blocks, keep = rss_mib(), [], []
for i in range(40):
    blocks.append(b"y" * (2 << 20))
    keep.append(bytes(700) + bytes([i]))  # small blocks between them stay in use
del blocks
print(rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_blocks_go_back_at_once_with_a_fixed_mmap_threshold():
    def held_mib(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", HEAP_AFTER_LARGE_BLOCKS, mode],
                             capture_output=True, text=True, check=True)
        return float(out.stdout)

    assert held_mib("default") > 60  # 80 MiB freed into the heap, kept there
    assert held_mib("mapped") < 5  # each block was its own mapping, unmapped by free()
