"""Torch reference implementations of every kernel in this package.

They are the CPU path of the executor and the oracle the Triton kernels are tested against, so
they favour clarity over speed. Shapes follow the paged KV-cache layout used everywhere:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A step is a flat ("varlen") batch of T query tokens from B sequences. Sequence b owns query rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]; its context (cached tokens plus the new ones, whose K/V have
already been written) is seq_lens[b] tokens long, so its j-th new token sits at absolute position
seq_lens[b] - q_len_b + j and attends causally to keys 0..that position.

paged_attention takes three options of newer model families, the same in the Triton version:
sliding_window W > 0 lets the query at position i see only keys i - W < j <= i (W keys, itself
included: HF transformers' sliding_window_overlay, Mistral, Gemma 2/3's local layers),
logits_soft_cap c > 0 replaces each score s = q.k * scale by c * tanh(s / c) before the mask
and the softmax (Gemma 2's attn_logit_softcapping); 0 turns either off. sinks ([H] float, one
logit a query head; None: off) joins the softmax as one more column after the cap and the
mask and is dropped before V: p_j = exp(s_j) / (exp(sink_h) + sum_i exp(s_i)) (gpt-oss, as
transformers' eager_attention_forward).

An FP8 cache (float8_e4m3fn) holds saturate(x / scale), one scale for K and one for V; reads
give stored * scale in float32. Caches of other dtypes ignore the scales.
"""

from __future__ import annotations

import numbers

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


def check_attention_options(sliding_window: int, logits_soft_cap: float) -> None:
    """sliding_window an int >= 0 and logits_soft_cap a finite number >= 0 (0: off), else
    ValueError. The Triton paged_attention checks its options with this too."""
    if (isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral)
            or sliding_window < 0):
        raise ValueError(f"sliding_window must be an int >= 0 (0: off), got {sliding_window!r}")
    if (isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real)
            or not 0 <= logits_soft_cap < float("inf")):
        raise ValueError("logits_soft_cap must be a finite number >= 0 (0: off), "
                         f"got {logits_soft_cap!r}")


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """sinks None or a 1-D float tensor of one logit per query head on q's device, else
    ValueError. The Triton paged_attention checks its sinks with this too."""
    if sinks is None:
        return
    want = f"a 1-D float tensor of num_heads ({q.shape[1]}) entries on {q.device}"
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be {want} or None, got {type(sinks).__name__}")
    if (sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or not sinks.is_floating_point()
            or sinks.device != q.device):
        raise ValueError(f"sinks must be {want} or None, got shape {tuple(sinks.shape)} "
                         f"{sinks.dtype} on {sinks.device}")


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
    sliding_window: int = 0,  # > 0: the query at position i sees keys i - W < j <= i only
    logits_soft_cap: float = 0.0,  # > 0: scores become cap * tanh(score / cap)
    sinks: torch.Tensor | None = None,  # [H] float: a logit a head in the softmax, no value
) -> torch.Tensor:  # [T, H, D]
    check_attention_options(sliding_window, logits_soft_cap)
    check_sinks(sinks, q)
    out = torch.empty_like(q)
    scales = (k_scale, v_scale)
    opts = (int(sliding_window), float(logits_soft_cap), None if sinks is None else sinks.float())
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decode:  # all single-token rows in one batched product: the CPU decode hot path
        rows = [cu[b] for b in decode]
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[decode],
                                      seq_lens[decode], scale, scales, *opts)
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end - start > 1:
            out[start:end] = _sequence_attention(q[start:end], k_cache, v_cache,
                                                 block_tables[b], ctx, scale, scales, *opts)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first ctx tokens of a block table (or a batch of them): [..., ctx, Hkv, D]."""
    g = cache[blocks.long()]  # [..., nblocks, BS, Hkv, D]
    return g.flatten(-4, -3)[..., :ctx, :, :]


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return scores if cap == 0 else cap * torch.tanh(scores / cap)


def _softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim, with the sink (broadcast to scores[..., :1]) as one more
    column, dropped after."""
    if sink is None:
        return scores.softmax(dim=-1)
    sink = sink.expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales, window, cap,
                      sinks):
    # q: [B, H, D]; one query per sequence, at the last position of its context
    bsz, h, d = q.shape
    hkv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    lens = seq_lens.long()
    max_ctx = int(lens.max())
    lo = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)  # first key seen
    first = int(lo.min()) // block_size  # blocks wholly before every window are not gathered
    nblocks = -(-max_ctx // block_size)
    pos = torch.arange(first * block_size, nblocks * block_size, device=q.device)  # [S]
    # table entries past a sequence's own blocks may be anything (padding): point them at block 0
    used = torch.arange(first, nblocks, device=q.device)[None, :] * block_size < lens[:, None]
    tables = torch.where(used, block_tables[:, first:nblocks], 0)
    k = _load(_gather(k_cache, tables, pos.numel()), kv_scales[0])  # [B, S, Hkv, D]
    v = _load(_gather(v_cache, tables, pos.numel()), kv_scales[1])
    qg = q.float().view(bsz, hkv, h // hkv, d)  # query heads grouped by their KV head
    scores = _soft_cap(torch.einsum("bkgd,bskd->bkgs", qg, k) * scale, cap)  # [B, Hkv, G, S]
    valid = (pos[None, :] < lens[:, None]) & (pos[None, :] >= lo[:, None])
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    v = v.masked_fill(~valid[:, :, None, None], 0.0)  # stale or NaN slots must not leak in
    sink = None if sinks is None else sinks.reshape(1, hkv, h // hkv, 1)
    o = torch.einsum("bkgs,bskd->bkgd", _softmax(scores, sink), v)
    return o.reshape(bsz, h, d).to(q.dtype)


def _sequence_attention(q, k_cache, v_cache, block_table, ctx, scale, kv_scales, window, cap,
                        sinks):
    # q: [q_len, H, D], the last q_len positions of a ctx-token context, causal
    q_len, h, _ = q.shape
    block_size = k_cache.shape[1]
    group = h // k_cache.shape[2]
    lo = max(0, ctx - q_len + 1 - window) if window else 0  # first key any query sees
    first = lo // block_size  # gather from the block holding it
    nblocks = -(-ctx // block_size)
    n = ctx - first * block_size
    k = _load(_gather(k_cache, block_table[first:nblocks], n), kv_scales[0])  # [n, Hkv, D]
    v = _load(_gather(v_cache, block_table[first:nblocks], n), kv_scales[1])
    qb = q.transpose(0, 1).float()  # [H, q_len, D]
    kb = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, n, D]
    vb = v.transpose(0, 1).repeat_interleave(group, dim=0)
    if not (window or cap) and qb.device.type == "cpu" and _cpu_flash() is not None:
        o, lse = _prefix_then_causal(qb, kb, vb, scale)  # [H, q_len, D], [H, q_len]
        if sinks is not None:  # the keys' share of the softmax with the sink beside them,
            # L / (L + exp(sink)) for L = exp(lse): exact, and no score is written
            o = o * torch.sigmoid(lse - sinks[:, None])[..., None]
        return o.transpose(0, 1).to(q.dtype)
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
    k_pos = torch.arange(first * block_size, ctx, device=q.device)[None, :]
    mask = k_pos <= q_pos  # [q_len, n]
    if window:
        mask &= k_pos > q_pos - window
    if cap or sinks is not None:  # SDPA has neither soft cap nor sink: the scores by hand
        scores = _soft_cap(torch.einsum("hqd,hkd->hqk", qb, kb) * scale, cap)
        sink = None if sinks is None else sinks.reshape(h, 1, 1)
        p = _softmax(scores.masked_fill(~mask, float("-inf")), sink)
        o = torch.einsum("hqk,hkd->hqd", p, vb)
    else:
        o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask,
                                                             scale=scale)
    return o.transpose(0, 1).to(q.dtype)


def _cpu_flash():
    """torch's CPU flash attention, which also gives each row's log-sum-exp; None where this
    torch has none."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_then_causal(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the last q_len positions of n ([H, q_len, D] over [H, n, D]) as two
    CPU flash passes merged by their log-sum-exps: the keys before the chunk (all visible),
    then the chunk's own (causal, aligned at its start). SDPA given the bottom-right mask
    takes its math path and writes every score: [9, 2,048, 16k] float32 is 1.2 GB for one
    layer of the default model, and a 16k-token prompt prefilled 4x slower (254 s). Returns
    the output [H, q_len, D] and each row's log-sum-exp [H, q_len]."""
    flash = _cpu_flash()
    q_len, n = qb.shape[1], kb.shape[1]
    q4 = qb[None]
    o_own, lse_own = flash(q4, kb[None, :, n - q_len:], vb[None, :, n - q_len:], 0.0, True,
                           scale=scale)
    if n == q_len:
        return o_own[0], lse_own[0]
    o_pre, lse_pre = flash(q4, kb[None, :, :n - q_len], vb[None, :, :n - q_len], 0.0, False,
                           scale=scale)
    top = torch.maximum(lse_pre, lse_own)
    w_pre, w_own = (lse_pre - top).exp()[..., None], (lse_own - top).exp()[..., None]
    w = w_pre + w_own
    return ((o_pre * w_pre + o_own * w_own) / w)[0], (top + w[..., 0].log())[0]


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
    *,
    q_norm_weight: torch.Tensor | None = None,  # [D]: RMSNorm over each head first
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style ("rotate half") rotary embedding, as HF Llama applies it; with the norm
    weights, each head of q and k is RMS-normalised over head_dim first (Qwen3's q_norm and
    k_norm, as HF applies them before the rotation)."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    if q_norm_weight is not None:
        d = q.shape[-1]
        q = rms_norm(q.reshape(-1, d), q_norm_weight, norm_eps)[0].reshape(q.shape)
        k = rms_norm(k.reshape(-1, d), k_norm_weight, norm_eps)[0].reshape(k.shape)
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def rotary_and_cache(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative: not stored
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> torch.Tensor:
    """rotary_embedding, then write_kv_cache of the rotated k and of v; the rotated q."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache, q_norm_weight=q_norm_weight,
                            k_norm_weight=k_norm_weight, norm_eps=norm_eps)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """GeGLU (Gemma): gelu(gate, approximate="tanh") * up, gate the first half."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
