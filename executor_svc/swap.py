"""Host-memory swap space for preempted requests' KV blocks.

The scheduler decides what moves where; this copies. Layout mirrors the device cache:
per layer, K and V tensors of [num_swap_blocks, block_size, num_kv_heads, head_dim] (one where
the layer's K is its V, as latent attention's), pinned when
the device is a GPU so that copies run at full PCIe speed. Blocks move as raw bytes (uint8
views), so an FP8 cache swaps like any other: torch has no CPU index_copy_ for float8 dtypes.

The space is committed when made (pinned memory is; plain host memory is written through once),
so the executor's resident memory at start is its memory under load: a container's limit is
met at start, not when requests are first swapped out mid-service.
"""

from __future__ import annotations

import torch


class SwapSpace:
    def __init__(self, num_blocks: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.num_blocks = num_blocks
        pin = bool(like) and like[0][0].is_cuda
        self.host = [
            tuple(torch.empty((num_blocks, *_raw(t).shape[1:]), dtype=torch.uint8,
                              pin_memory=pin)
                  for t in distinct_caches(layer))
            for layer in like
        ] if num_blocks > 0 else []
        if not pin:
            for layer in self.host:
                for t in layer:
                    t.zero_()

    def swap_out(self, device_kv: list[tuple[torch.Tensor, torch.Tensor]], src: list[int],
                 dst: list[int]) -> None:
        """Device blocks src[i] -> host blocks dst[i], for every layer, K and V."""
        if not src:
            return
        src_t = torch.tensor(src, device=device_kv[0][0].device)
        dst_t = torch.tensor(dst)
        for dev_layer, host_layer in zip(device_kv, self.host, strict=True):
            for dev, host in zip(distinct_caches(dev_layer), host_layer, strict=True):
                host.index_copy_(0, dst_t, _raw(dev).index_select(0, src_t).cpu())

    def swap_in(self, device_kv: list[tuple[torch.Tensor, torch.Tensor]], src: list[int],
                dst: list[int]) -> None:
        """Host blocks src[i] -> device blocks dst[i], for every layer, K and V."""
        if not src:
            return
        device = device_kv[0][0].device
        src_t = torch.tensor(src)
        dst_t = torch.tensor(dst, device=device)
        for dev_layer, host_layer in zip(device_kv, self.host, strict=True):
            for dev, host in zip(distinct_caches(dev_layer), host_layer, strict=True):
                _raw(dev).index_copy_(0, dst_t, host.index_select(0, src_t).to(
                    device, non_blocking=True))


def distinct_caches(layer: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A layer's caches, each tensor once (latent attention's K is its V: one tensor)."""
    return tuple(t for i, t in enumerate(layer) if all(t is not u for u in layer[:i]))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """t's bytes: [N, BS, Hkv, D * itemsize] uint8, a view (the cache is contiguous)."""
    return t.view(torch.uint8)
