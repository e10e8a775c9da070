import subprocess
import sys

import pytest
import torch

from pagedserve.executor.swap import SwapSpace
from pagedserve.executor.worker import ExecutorConfig, swap_space_bytes


def test_blocks_round_trip_through_host_memory():
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g))
          for _ in range(3)]
    saved = [(k[[1, 4]].clone(), v[[1, 4]].clone()) for k, v in kv]
    swap = SwapSpace(5, kv)
    swap.swap_out(kv, src=[1, 4], dst=[3, 0])
    for k, v in kv:  # the device blocks get reused by someone else
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    swap.swap_in(kv, src=[3, 0], dst=[5, 2])
    for (k, v), (k_want, v_want) in zip(kv, saved, strict=True):
        assert torch.equal(k[[5, 2]], k_want) and torch.equal(v[[5, 2]], v_want)
        assert torch.isnan(k[0]).all()  # nothing else was written


def test_a_layer_whose_k_is_its_v_swaps_one_tensor():
    # latent attention (worker.allocate_kv(shared=True)): one host tensor a layer, not two
    from pagedserve.executor.worker import allocate_kv

    kv = allocate_kv((6, 4, 1, 8), torch.float32, torch.device("cpu"), 2, shared=True)
    assert all(k is v for k, v in kv)
    for k, _ in kv:
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(2)))
    saved = [k[[1, 4]].clone() for k, _ in kv]
    swap = SwapSpace(5, kv)
    assert [len(layer) for layer in swap.host] == [1, 1]
    swap.swap_out(kv, src=[1, 4], dst=[3, 0])
    for k, _ in kv:
        k.fill_(float("nan"))
    swap.swap_in(kv, src=[3, 0], dst=[5, 2])
    for (k, _), want in zip(kv, saved, strict=True):
        assert torch.equal(k[[5, 2]], want) and torch.isnan(k[0]).all()


def test_no_swap_space_is_a_no_op():
    swap = SwapSpace(0, [])
    swap.swap_out([], [], [])
    assert swap.num_blocks == 0


def test_fp8_blocks_round_trip_bit_for_bit():
    # torch has no CPU index_copy_ for float8: the swap space moves the blocks' bytes
    g = torch.Generator().manual_seed(1)
    kv = [tuple((torch.randn(6, 4, 2, 8, generator=g) * 100).to(torch.float8_e4m3fn)
                for _ in range(2)) for _ in range(2)]
    saved = [(k[[1, 4]].view(torch.uint8).clone(), v[[1, 4]].view(torch.uint8).clone())
             for k, v in kv]
    swap = SwapSpace(5, kv)
    swap.swap_out(kv, src=[1, 4], dst=[3, 0])
    for k, v in kv:
        k.view(torch.uint8).fill_(0x7F)  # NaN
        v.view(torch.uint8).fill_(0x7F)
    swap.swap_in(kv, src=[3, 0], dst=[5, 2])
    for (k, v), (k_want, v_want) in zip(kv, saved, strict=True):
        assert k.dtype == torch.float8_e4m3fn
        assert torch.equal(k[[5, 2]].view(torch.uint8), k_want)
        assert torch.equal(v[[5, 2]].view(torch.uint8), v_want)
        assert (k[0].view(torch.uint8) == 0x7F).all()


RESIDENT_AFTER = """
import os, sys, torch
from pagedserve.executor.swap import SwapSpace
from pagedserve.executor.worker import allocate_kv
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss_mib()
kv = allocate_kv((128, 16, 8, 64), torch.bfloat16, torch.device("cpu"), 16)  # 64 MiB
assert len(kv) == 16 and not kv[3][1].any()
kv_mib = rss_mib() - before
swap = SwapSpace(64, kv)  # half the blocks: 32 MiB
print(kv_mib, rss_mib() - before - kv_mib)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
def test_the_host_kv_cache_and_swap_space_are_resident_from_the_start():
    """On the CPU the KV cache and the swap space are committed when made: the resident memory
    at start is the memory under load (a pod's limit is met at start, not as blocks are first
    written or swapped out). In a fresh process: in this one, freed pages of earlier tests would
    serve the allocation."""
    out = subprocess.run([sys.executable, "-c", RESIDENT_AFTER], capture_output=True,
                         text=True, check=True, timeout=120)
    kv_mib, swap_mib = map(float, out.stdout.split())
    assert kv_mib > 60 and swap_mib > 30, (kv_mib, swap_mib)


def test_the_swap_space_defaults_by_device():
    """4 GiB of pinned memory beside a GPU's cache, none on the CPU (the cache is host memory
    already); a size given is kept on either."""
    cfg = ExecutorConfig(model="m")
    assert swap_space_bytes(cfg, torch.device("cuda")) == 4 << 30
    assert swap_space_bytes(cfg, torch.device("cpu")) == 0
    given = ExecutorConfig(model="m", swap_space_bytes=1 << 20)
    assert swap_space_bytes(given, torch.device("cpu")) == 1 << 20
