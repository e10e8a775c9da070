"""Torch reference implementations of every kernel in this package.

They are the CPU path of the executor and the oracle the Triton kernels are tested against, so
they favour clarity over speed. Shapes follow the paged KV-cache layout used everywhere:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A step is a flat ("varlen") batch of T query tokens from B sequences. Sequence b owns query rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]; its context (cached tokens plus the new ones, whose K/V have
already been written) is seq_lens[b] tokens long, so its j-th new token sits at absolute position
seq_lens[b] - q_len_b + j and attends causally to keys 0..that position.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot means "do not store" (padding)
) -> None:
    num_blocks, block_size, hkv, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(num_blocks * block_size, hkv, d)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, hkv, d)[slots] = value[valid].to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this step's tokens
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        qb = q[start:end].transpose(0, 1).float()  # [H, q_len, D]
        kb = k.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, ctx, D]
        vb = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [q_len, ctx]
        o = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, scale=scale
        )
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual) where new_residual = x + residual (or x)."""
    if residual is not None:
        x = x + residual
    new_residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), new_residual


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style ("rotate half") rotary embedding, as HF Llama applies it."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
