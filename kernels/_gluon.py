"""Gluon's Hopper pieces, imported in one place for the Gluon kernels (w4a16_gluon.py,
paged_prefill_hopper.py). Gluon is experimental, present in Triton >= 3.5: without it every
name here is None and those kernels report themselves unavailable (`gluon is None`)."""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # TMA global-to-shared copy: async_copy_global_to_shared in Triton 3.6, async_load (same
    # arguments) from 3.7, where the old name raises
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # a barrier of the warps that run it (inside a warp_specialize partition, its warps):
    # thread_barrier in Triton 3.6, barrier from 3.7
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError:  # pragma: no cover - older Triton
    gluon = gl = fence_async_shared = mbarrier = tma = thread_barrier = None
    warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = tma_load = None
