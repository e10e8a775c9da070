"""Paged attention over a mixed varlen batch (decode rows and (chunked) prefill rows together).

One program owns BLOCK_Q query tokens x all GROUP query heads of one KV head (GQA packing, so a
decode row still fills the 16-row minimum of tl.dot and K/V tiles are read once per group). Query
blocks are laid out per sequence as ``cu_seqlens_q[b] // BLOCK_Q + b``, an upper bound that needs
no host sync; a program finds its sequence by binary search and exits if its block is empty.

When there are too few programs to fill the GPU (small-batch decode), the context is split across
``num_splits`` programs that write fp32 partials (max, sum, acc); a second kernel merges them
(flash-decoding).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_inner_contiguous, check_out, check_tensor

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_q_ptr, num_seqs, qb, BLOCK_Q: tl.constexpr):
    # Largest b with cu_q[b] // BLOCK_Q + b <= qb.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= qb:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d,
    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASK: tl.constexpr,
):
    k_pos = tile * TILE_N + tl.arange(0, TILE_N)
    if MASK:
        k_ok = k_pos < kv_end
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
    slot_in = k_pos % BLOCK_SIZE
    k_ptrs = k_base + (blk * stride_kb + slot_in * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = v_base + (blk * stride_vb + slot_in * stride_vs)[:, None] + offs_d[None, :]
    k = tl.load(k_ptrs, mask=k_ok[:, None], other=0.0) if MASK else tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, TILE_N], log2 domain
    if MASK:
        keep = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row can see no key in this tile (causal, or a split past its position): keep it finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0) if MASK else tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_q_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, num_seqs, num_heads, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(cu_q_ptr, num_seqs, qb, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    q_tok0 = (qb - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_tok0 >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_tok0 + offs_m // GROUP  # token index within the sequence's queries
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (tok < q_len) & (offs_m < BLOCK_Q * GROUP)
    row_t = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (row_t * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = ctx - q_len + tok  # absolute position of each query row

    first_pos = ctx - q_len + q_tok0
    kv_end = tl.minimum(ctx, first_pos + BLOCK_Q)  # keys any row of this block may see
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SPLIT:
        per_split = tl.cdiv(num_tiles, num_splits)
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, num_tiles)
    else:
        t_lo = 0
        t_hi = num_tiles
    t_full = (first_pos + 1) // TILE_N  # tiles below t_full need no causal/length mask

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile in range(t_lo, tl.minimum(t_hi, t_full)):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, BLOCK_SIZE, TILE_N, False)
    for tile in range(tl.maximum(t_lo, t_full), t_hi):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, BLOCK_SIZE, TILE_N, True)

    if SPLIT:
        idx = (row_t * num_heads + head) * num_splits + split
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (row_t * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * num_heads + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@dataclass(frozen=True)
class Config:
    block_m: int  # query rows (tokens x group heads) per program
    tile_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int


def pick_config(max_query_len: int, group: int, dtype: torch.dtype) -> Config:
    rows = max_query_len * group
    block_m = max(16 if rows <= 16 else 64 if rows <= 64 else 128, triton.next_power_of_2(group))
    if block_m <= 16:  # decode: memory-bound, keep several tiles in flight
        return Config(block_m, 64, 4, 2 if dtype == torch.float32 else 4)
    return Config(block_m, 64, 8, 2 if dtype == torch.float32 else 3)


def _pick_num_splits(programs: int, device: torch.device, max_seq_len: int, tile_n: int) -> int:
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    want = triton.next_power_of_2(triton.cdiv(target, programs))
    most = max(1, triton.cdiv(max_seq_len, 4 * tile_n))  # keep >= 4 tiles per split
    return max(1, min(want, most, 64))


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> None:
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    check_tensor("k_cache", k_cache, 4, (q.dtype,), dev)
    check_tensor("v_cache", v_cache, 4, (q.dtype,), dev)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_inner_contiguous(name, t)
    _, _, hkv, d = k_cache.shape
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {d}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if q.shape[1] % hkv:
        raise ValueError(f"num_heads {q.shape[1]} not a multiple of num_kv_heads {hkv}")
    check_tensor("block_tables", block_tables, 2, (torch.int32,), dev)
    check_inner_contiguous("block_tables", block_tables)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), dev)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), dev)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"batch mismatch: seq_lens {num_seqs}, block_tables {block_tables.shape[0]}, "
            f"cu_seqlens_q {cu_seqlens_q.shape[0]} (want B+1)")
    if not seq_lens.is_contiguous() or not cu_seqlens_q.is_contiguous():
        raise ValueError("seq_lens and cu_seqlens_q must be contiguous")


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context incl. this step's tokens
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    scale: float,
    *,
    max_query_len: int | None = None,  # host-side hints; computed (a host sync) when None
    max_seq_len: int | None = None,
    num_splits: int | None = None,  # None: split the context only when programs are few
    out: torch.Tensor | None = None,  # [T, H, D], q's dtype
) -> torch.Tensor:
    """Same contract as kernels.reference.paged_attention.

    Rows of q past cu_seqlens_q[-1] (padding) are left unspecified in the output.
    """
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // num_kv_heads
    cfg = pick_config(max_query_len, group, q.dtype)
    if num_splits is None:
        block_q = cfg.block_m // group
        busy = num_seqs if max_query_len <= block_q else num_tokens // block_q + num_seqs
        if busy * num_kv_heads >= 2 * _num_sms(q.device):
            num_splits = 1
        else:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            num_splits = _pick_num_splits(busy * num_kv_heads, q.device, max_seq_len, cfg.tile_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, cfg, num_splits)
    return out


def launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale: float,
           out: torch.Tensor, cfg: Config, num_splits: int) -> None:
    """Launch with an explicit config; arguments must already be checked (benchmarks sweep this)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_q = cfg.block_m // group
    split = num_splits > 1
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim),
                               dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _paged_attn_kernel[(num_tokens // block_q + num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
        out, part_m, part_l, part_acc,
        scale * _LOG2E, num_seqs, num_heads, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, SPLIT=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_m, part_l, part_acc, out, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
        )
