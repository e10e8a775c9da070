"""What an executor's capacity (its hello) means for the scheduler: block pools, step bounds."""

from __future__ import annotations

import logging
from dataclasses import replace

from pagedserve.core.config import CPU_STEP_BOUNDS
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.block_manager import BlockManager, HostBlockPool
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("pagedserve.scheduler")


def adopt(scheduler: Scheduler | None, cfg: SchedulerConfig, cap: pb.Capacity,
          kv_watermark: float, eos_token_ids: frozenset[int]) -> Scheduler:
    """The scheduler for a newly joined executor: fresh block pools for its device and host KV
    (a new admission must leave `kv_watermark` of the device blocks free), step bounds within
    what it profiled. An existing scheduler keeps its requests: the new executor holds none of
    their KV, so every running one is recomputed."""
    watermark = int(cap.num_kv_blocks * kv_watermark)
    blocks = BlockManager(cap.num_kv_blocks, cap.block_size, watermark, cfg.enable_prefix_caching)
    host_blocks = HostBlockPool(cap.num_swap_blocks)
    if scheduler is None:
        return Scheduler(fit_step_bounds(cfg, cap), blocks, host_blocks, eos_token_ids)
    scheduler.preempt_all(blocks, host_blocks)
    scheduler.cfg = fit_step_bounds(cfg, cap)
    return scheduler


def fit_step_bounds(cfg: SchedulerConfig, cap: pb.Capacity) -> SchedulerConfig:
    """cfg with its step bounds lowered to what the executor's memory profile covered (a
    larger step could run it out of memory); 0 in cap means unbounded (CPU). A bound of 0 in
    cfg (the flags' default) takes the executor's, chosen for its device, or on the CPU
    core.config.CPU_STEP_BOUNDS."""
    for name, cpu in zip(("max_num_seqs", "max_num_batched_tokens"), CPU_STEP_BOUNDS,
                         strict=True):
        limit, ours = getattr(cap, name), getattr(cfg, name)
        if ours == 0:
            cfg = replace(cfg, **{name: limit or cpu})
        elif 0 < limit < ours:
            log.warning("%s %d is more than the executor profiled its memory for; using %d",
                        name, ours, limit)
            cfg = replace(cfg, **{name: limit})
    return cfg
