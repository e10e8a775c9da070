"""What an executor's capacity (its hello) means for the scheduler: block pools, step bounds."""

from __future__ import annotations

import logging
from dataclasses import replace

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.block_manager import BlockManager, HostBlockPool
from pagedserve.scheduler.scheduler import SchedulerConfig

log = logging.getLogger("pagedserve.scheduler")


def block_pools(cap: pb.Capacity, kv_watermark: float,
                enable_caching: bool) -> tuple[BlockManager, HostBlockPool]:
    """Fresh bookkeeping for the executor's device and host KV blocks; `kv_watermark` is the
    fraction of device blocks a new admission must leave free."""
    watermark = int(cap.num_kv_blocks * kv_watermark)
    return (BlockManager(cap.num_kv_blocks, cap.block_size, watermark, enable_caching),
            HostBlockPool(cap.num_swap_blocks))


def fit_step_bounds(cfg: SchedulerConfig, cap: pb.Capacity) -> SchedulerConfig:
    """cfg with its step bounds lowered to what the executor's memory profile covered (a
    larger step could run it out of memory); 0 in cap means unbounded (CPU)."""
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        limit, ours = getattr(cap, name), getattr(cfg, name)
        if 0 < limit < ours:
            log.warning("%s %d is more than the executor profiled its memory for; using %d",
                        name, ours, limit)
            cfg = replace(cfg, **{name: limit})
    return cfg
