"""Shared builders for the kernel tests: random paged batches and an error measure."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so it never passes."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [N, BS, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q)


def make_paged_batch(
    q_lens: list[int], ctxs: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
) -> PagedBatch:
    """Blocks are scattered at random; every cache slot no sequence owns (spare blocks, the tail
    of each last block) holds NaN, and unused block-table entries point far out of range, so a
    kernel that reads past a sequence's context produces NaN or faults."""
    assert all(0 <= q <= c for q, c in zip(q_lens, ctxs, strict=True))
    gen = torch.Generator().manual_seed(seed)
    need = [(c + block_size - 1) // block_size for c in ctxs]
    num_blocks = sum(need) + 3
    max_blocks = max(need) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    block_tables = torch.full((len(ctxs), max_blocks), 1 << 30, dtype=torch.int32)
    used = 0
    for b, (c, n) in enumerate(zip(ctxs, need, strict=True)):
        blocks = perm[used:used + n]
        used += n
        block_tables[b, :n] = blocks.int()
        flat_k = k_cache[blocks].flatten(0, 1)
        flat_v = v_cache[blocks].flatten(0, 1)
        flat_k[:c] = torch.randn((c, num_kv_heads, head_dim), generator=gen)
        flat_v[:c] = torch.randn((c, num_kv_heads, head_dim), generator=gen)
        k_cache[blocks] = flat_k.view(n, block_size, num_kv_heads, head_dim)
        v_cache[blocks] = flat_v.view(n, block_size, num_kv_heads, head_dim)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn((int(cu[-1]), num_heads, head_dim), generator=gen)
    to = {"device": device, "dtype": dtype}
    return PagedBatch(
        q.to(**to), k_cache.to(**to), v_cache.to(**to), block_tables.to(device),
        torch.tensor(ctxs, dtype=torch.int32, device=device), cu.to(device),
    )
