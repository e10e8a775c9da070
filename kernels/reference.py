"""Torch reference implementations of every kernel in this package.

They are the CPU path of the executor and the oracle the Triton kernels are tested against, so
they favour clarity over speed. Shapes follow the paged KV-cache layout used everywhere:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A step is a flat ("varlen") batch of T query tokens from B sequences. Sequence b owns query rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]; its context (cached tokens plus the new ones, whose K/V have
already been written) is seq_lens[b] tokens long, so its j-th new token sits at absolute position
seq_lens[b] - q_len_b + j and attends causally to keys 0..that position.

An FP8 cache (float8_e4m3fn) holds saturate(x / scale), one scale for K and one for V; reads
give stored * scale in float32. Caches of other dtypes ignore the scales.
"""

from __future__ import annotations

import torch

from pagedserve.kernels._checks import FP8_KV_DTYPE, FP8_MAX


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the FP8 cache stores it: x / scale, saturated to +-448, rounded to nearest even."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def _load(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Gathered cache rows in float32, dequantized when the cache is FP8."""
    if cache.dtype == FP8_KV_DTYPE:
        return cache.float() * scale
    return cache.float()


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot means "do not store" (padding)
    k_scale: float = 1.0,  # FP8 caches only
    v_scale: float = 1.0,
) -> None:
    num_blocks, block_size, hkv, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if k_cache.dtype == FP8_KV_DTYPE:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
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
    *,
    max_query_len: int | None = None,  # host-side hints the Triton version uses; unused here
    max_seq_len: int | None = None,
    k_scale: float = 1.0,  # FP8 caches only: keys read as stored * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    out = torch.empty_like(q)
    scales = (k_scale, v_scale)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decode:  # all single-token rows in one batched product: the CPU decode hot path
        rows = [cu[b] for b in decode]
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[decode],
                                      seq_lens[decode], scale, scales)
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end - start > 1:
            out[start:end] = _sequence_attention(q[start:end], k_cache, v_cache,
                                                 block_tables[b], ctx, scale, scales)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first ctx tokens of a block table (or a batch of them): [..., ctx, Hkv, D]."""
    g = cache[blocks.long()]  # [..., nblocks, BS, Hkv, D]
    return g.flatten(-4, -3)[..., :ctx, :, :]


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales):
    # q: [B, H, D]; one query per sequence, at the last position of its context
    bsz, h, d = q.shape
    hkv = k_cache.shape[2]
    max_ctx = int(seq_lens.max())
    block_size = k_cache.shape[1]
    nblocks = -(-max_ctx // block_size)
    # table entries past a sequence's own blocks may be anything (padding): point them at block 0
    used = torch.arange(nblocks, device=q.device)[None, :] * block_size < seq_lens[:, None]
    tables = torch.where(used, block_tables[:, :nblocks], 0)
    k = _load(_gather(k_cache, tables, max_ctx), kv_scales[0])  # [B, S, Hkv, D]
    v = _load(_gather(v_cache, tables, max_ctx), kv_scales[1])
    qg = q.float().view(bsz, hkv, h // hkv, d)  # query heads grouped by their KV head
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k) * scale  # [B, Hkv, G, S]
    valid = torch.arange(max_ctx, device=q.device)[None, :] < seq_lens[:, None].long()
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    v = v.masked_fill(~valid[:, :, None, None], 0.0)  # stale or NaN slots must not leak in
    o = torch.einsum("bkgs,bskd->bkgd", scores.softmax(dim=-1), v)
    return o.reshape(bsz, h, d).to(q.dtype)


def _sequence_attention(q, k_cache, v_cache, block_table, ctx, scale, kv_scales):
    # q: [q_len, H, D], the last q_len positions of a ctx-token context, causal
    q_len, h, _ = q.shape
    group = h // k_cache.shape[2]
    nblocks = -(-ctx // k_cache.shape[1])
    k = _load(_gather(k_cache, block_table[:nblocks], ctx), kv_scales[0])  # [ctx, Hkv, D]
    v = _load(_gather(v_cache, block_table[:nblocks], ctx), kv_scales[1])
    qb = q.transpose(0, 1).float()  # [H, q_len, D]
    kb = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, ctx, D]
    vb = v.transpose(0, 1).repeat_interleave(group, dim=0)
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
    mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [q_len, ctx]
    o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
    return o.transpose(0, 1).to(q.dtype)


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
