"""Weights pulled into the GPU's L2 on a side stream while the kernels before their reader run.

A decode step of one sequence is a chain of small kernels: a weight read (a GEMV) waits for
the short, latency-bound kernels before it (rotary, attention and its split merge before
o_proj) while HBM idles. On the H100 the o_proj GEMV of Qwen3-30B-A3B reads its 16.8 MB at
~1.7 TB/s (docs/performance.md). `start` forks a side stream from the current one and asks
the L2 for the weights there (`cp.async.bulk.prefetch.L2`, one instruction per 4 KiB, Hopper
and later: the TMA unit fetches, so the prefetch's few programs hold no registers waiting);
`join` makes the current stream wait for the side stream before the weights' reader. Inside
CUDA-graph capture both become graph edges. The prefetch only reads weights that nothing in the
step writes, so it changes no result, only when the bytes arrive.

Off by default (PAGEDSERVE_L2_PREFETCH_ROWS, executor_svc/layers.py) until a GPU times it:
benchmarks/kernels/bench_gemv.py --prefetch, gpu.sh part `prefetch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # bytes one bulk prefetch asks for
BLOCK = 64  # chunks a program asks for (256 KiB)


@triton.jit
def _prefetch_l2_kernel(ptr, nbytes, CHUNK_ELEMS: tl.constexpr, CHUNK_BYTES: tl.constexpr,
                        BLOCK: tl.constexpr):
    chunks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    last = (nbytes - 1) // CHUNK_BYTES
    chunks = tl.minimum(chunks, last)  # past the end: the last chunk again (a hint, no fault)
    size = tl.minimum(nbytes - chunks.to(tl.int64) * CHUNK_BYTES, CHUNK_BYTES) // 16 * 16
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [ptr + chunks.to(tl.int64) * CHUNK_ELEMS, size.to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


def supported(t: torch.Tensor) -> bool:
    """A CUDA tensor of Hopper or later (the bulk prefetch), contiguous, 16-byte aligned, of at
    least 16 bytes (the prefetch's unit)."""
    return (t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9
            and t.is_contiguous() and t.data_ptr() % 16 == 0
            and t.numel() * t.element_size() >= 16)


def prefetch_l2(t: torch.Tensor) -> None:
    """Ask the L2 for t's bytes on the current stream (one launch; no result)."""
    nbytes = t.numel() * t.element_size()
    grid = triton.cdiv(triton.cdiv(nbytes, CHUNK), BLOCK)
    _prefetch_l2_kernel[(grid,)](t, nbytes, CHUNK_ELEMS=CHUNK // t.element_size(),
                                 CHUNK_BYTES=CHUNK, BLOCK=BLOCK, num_warps=2)


_SIDE: dict[int, torch.cuda.Stream] = {}


def start(*weights: torch.Tensor) -> torch.cuda.Stream | None:
    """Prefetch the supported weights on a side stream forked from the current one; the
    stream to `join`, or None when none was supported."""
    weights = tuple(w for w in weights if supported(w))
    if not weights:
        return None
    device = weights[0].device
    side = _SIDE.get(device.index)
    if side is None:
        side = _SIDE[device.index] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for w in weights:
            prefetch_l2(w)
    return side


def join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for `start`'s side stream (nothing when it was None)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
