"""Paged attention over a mixed varlen batch (decode rows and (chunked) prefill rows together).

A program owns BLOCK_Q query tokens x the GROUP query heads of one KV head (GQA packing: a decode
row fills tl.dot's 16-row minimum and each K/V tile is read once per group). One call makes two
launches of the same kernel, each skipping the sequences that belong to the other:

- short rows (q_len <= BLOCK_Q of a 16-row block; decode): one program per (sequence, KV head,
  split). With few sequences the context is split over ``num_splits`` programs that write fp32
  partials (max, sum, acc) merged by a second kernel (flash-decoding).
- long rows (prefill, chunks): 64/128-row blocks laid out per sequence at
  ``cu_seqlens_q[b] // BLOCK_Q + b``, an upper bound needing no host sync; a program finds its
  sequence by binary search and exits if its block is empty. When those programs are few (a
  chunk of a long prompt: a 512-token chunk of an 8-KV-head model makes 128 on 132 SMs, each
  walking every key), the keys are split as decode's are, the partials merged per token.

So decode rows keep their small, fast config even when a prefill shares the step. On an sm_90
GPU the long rows' launch goes to the Gluon kernel of paged_prefill_hopper.py where it covers
them (16-bit cache, head 64/128/256; its keys split and merged here when a chunk's programs
are few) and is the faster (from 4,096 keys; PAGEDSERVE_PREFILL_KERNEL=hopper or portable
forces the choice).

An FP8 cache (float8_e4m3fn) is read as stored * scale: K and V tiles are widened to q's dtype,
fp16 when q is bf16 (exact: every e4m3 value is an fp16 value), and the dots run as for a
16-bit cache; k_scale folds into the softmax scale and v_scale into the output, so no tile is
multiplied.

Options (0 or None = off, and compiled out then; same contract as the reference):

- sliding_window W: the query at position i sees keys i - W < j <= i. A block's tile loop
  starts at the first tile any of its rows can see, so tiles wholly before the window are
  never read; only the tiles holding the window's lower edge are masked for it. With context
  splits, the splits share out the visible tiles, not the whole context.
- logits_soft_cap c: scores become c * tanh(score / c) before the mask and the softmax.
- sinks ([H] float, gpt-oss): a logit per query head that joins each row's softmax with no
  value, so the weights sum to less than 1. The online softmax starts from it (m = sink,
  l = 1) in context split 0 alone, so the merge counts it once. The Hopper kernel takes no
  sinks: with them the long rows run here.
- head_dim need not be a power of two (Phi-3's 96, 80): it is padded to the next one, masked.
  Up to 256 as every family's heads; up to 1024 for latent attention's one KV head (DeepSeek
  V3's 576: the latent and its rope part, padded to 1024), on narrow tiles (wide_config).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import paged_prefill_hopper as hopper
from pagedserve.kernels._checks import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    check_inner_contiguous,
    check_out,
    check_tensor,
)
from pagedserve.kernels.reference import check_attention_options, check_sinks

_LOG2E = 1.4426950408889634
MAX_AUTO_SPLITS = 64  # the most context splits _pick_num_splits (and hopper.num_splits) picks


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
def _long_block(cu_q_ptr, num_seqs, qb, BLOCK_Q: tl.constexpr):
    """Query block qb of the long-row layout: (sequence, its first query row, its query
    count, the block's first token within the sequence's queries)."""
    seq = _find_seq(cu_q_ptr, num_seqs, qb, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    q_tok0 = (qb - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    return seq, q_start, q_len, q_tok0


@triton.jit
def _load_kv(ptrs, k_ok, d_ok, MASK: tl.constexpr, PAD_D: tl.constexpr):
    if MASK:
        if PAD_D:
            return tl.load(ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        return tl.load(ptrs, mask=k_ok[:, None], other=0.0)
    if PAD_D:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d, d_ok,
    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, soft_cap,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASK: tl.constexpr,
    WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, PAD_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    k_pos = tile * TILE_N + tl.arange(0, TILE_N)
    k_ok = k_pos < kv_end
    if MASK:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
    slot_in = k_pos % BLOCK_SIZE
    k_ptrs = k_base + (blk * stride_kb + slot_in * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = v_base + (blk * stride_vb + slot_in * stride_vs)[:, None] + offs_d[None, :]
    k = _load_kv(k_ptrs, k_ok, d_ok, MASK, PAD_D)
    # [BLOCK_M, TILE_N], log2 domain
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if SOFT_CAP:
        # s is log2(e) * x for the natural score x; c * tanh(x / c) in the same domain is
        # log2(e) * c * (2 / (1 + exp(-2x / c)) - 1), and exp(-2x / c) = exp2(-2s / c).
        # (tanh as 2 * sigmoid(2u) - 1: the interpreter has no libdevice tanh.)
        u = tl.exp2(s * (-2.0 / soft_cap))  # exp(-2x / c)
        s = (soft_cap * 1.4426950408889634) * (2.0 / (1.0 + u) - 1.0)
    if MASK:
        keep = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOW:
            keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row can see no key in this tile (causal, or a split past its position): keep it finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv(v_ptrs, k_ok, d_ok, MASK, PAD_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=PRECISION)
    return m_new, l_i, acc


# Ints that change from step to step are not specialised on: Triton would compile a variant
# for each of value == 1 / divisible by 16 / other, and a compile met while serving stalls the
# step for seconds. stride_bt is one of them: an eager step's block table is as wide as its
# longest sequence needs (a CUDA graph's is fixed), so its divisibility by 16 changes as
# contexts grow. The executor logs any compile after start (jit_watch.py). The window is
# fixed per layer, but a test of its value class would only buy variants; HAS_WINDOW and
# SOFT_CAP are constexpr, so layers without either compile the plain kernel.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_q_len", "stride_bt", "window"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_q_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr,
    qk_scale, v_scale, num_seqs, num_heads, num_splits, min_q_len, window, soft_cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, PER_SEQ: tl.constexpr, SPLIT: tl.constexpr, WIDEN_F16: tl.constexpr,
    PAD_D: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
):
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PER_SEQ:  # short rows: program = sequence, whose queries fit in one block
        seq = tl.program_id(0)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        q_tok0 = 0
        if (q_len == 0) | (q_len > BLOCK_Q):
            return
    else:  # long rows: only sequences with q_len >= min_q_len
        seq, q_start, q_len, q_tok0 = _long_block(cu_q_ptr, num_seqs, tl.program_id(0),
                                                   BLOCK_Q)
        if (q_tok0 >= q_len) | (q_len < min_q_len):
            return
    ctx = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok = q_tok0 + offs_m // GROUP  # token index within the sequence's queries
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (tok < q_len) & (offs_m < BLOCK_Q * GROUP)
    row_t = (q_start + tok).to(tl.int64)
    # PAD_D: head_dim padded to BLOCK_D, a power of two; the lanes past it are masked
    q_mask = row_ok[:, None] & d_ok[None, :] if PAD_D else row_ok[:, None]
    q = tl.load(q_ptr + (row_t * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=q_mask, other=0.0)
    if WIDEN_F16:  # an FP8 cache: its tiles widen to q's dtype, and e4m3 -> fp16 is one
        # conversion per two values on sm89+ where e4m3 -> bf16 goes through fp32; fp16 q
        # (clamped to its range) also keeps 3 more mantissa bits than bf16
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    q_pos = ctx - q_len + tok  # absolute position of each query row

    first_pos = ctx - q_len + q_tok0
    kv_end = tl.minimum(ctx, first_pos + BLOCK_Q)  # keys any row of this block may see
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if HAS_WINDOW:
        # first tile any row sees (the first row's window starts lowest); tiles from t_win on
        # hold only keys inside every row's window (the last row's starts at kv_end - window)
        t_first = tl.maximum(first_pos - window + 1, 0) // TILE_N
        t_win = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N)
    else:
        t_first = 0
        t_win = 0
    if SPLIT:  # the splits share out the tiles the block sees
        per_split = tl.cdiv(num_tiles - t_first, num_splits)
        t_lo = t_first + split * per_split
        t_hi = tl.minimum(t_lo + per_split, num_tiles)
    else:
        t_lo = t_first
        t_hi = num_tiles
    t_full = (first_pos + 1) // TILE_N  # tiles below t_full need no causal/length mask

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # the sink: a key every row sees, of score sink (natural units of the scaled score,
        # so no k_scale) and value 0. Only split 0 starts from it, so the merge counts it
        # once; a row that sees no key in split 0 still leaves a valid partial (m = sink,
        # l = 1, acc = 0), and the other splits' empty partials weigh 0 as before.
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 domain, as qk_scale
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_WINDOW:
        # Masked: the window's lower edge [t_lo, t_win) and the causal tail from t_tail, in
        # one loop (a third pipelined loop cost 30 % at B=64 decode), then the rest unmasked.
        t_mid = tl.maximum(t_lo, t_win)
        t_tail = tl.maximum(t_mid, t_full)
        n_edge = tl.minimum(t_hi, t_win) - t_lo
        for i in range(0, tl.maximum(n_edge, 0) + tl.maximum(t_hi - t_tail, 0)):
            tile = tl.where(i < n_edge, t_lo + i, t_tail + i - tl.maximum(n_edge, 0))
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d, d_ok,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, soft_cap,
                BLOCK_SIZE, TILE_N, True, True, SOFT_CAP, PAD_D, PRECISION)
        for tile in range(t_mid, tl.minimum(t_hi, t_full)):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d, d_ok,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, soft_cap,
                BLOCK_SIZE, TILE_N, False, False, SOFT_CAP, PAD_D, PRECISION)
    else:
        for tile in range(t_lo, tl.minimum(t_hi, t_full)):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d, d_ok,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, soft_cap,
                BLOCK_SIZE, TILE_N, False, False, SOFT_CAP, PAD_D, PRECISION)
        for tile in range(tl.maximum(t_lo, t_full), t_hi):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, kv_end, bt_row, k_base, v_base, offs_d, d_ok,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, soft_cap,
                BLOCK_SIZE, TILE_N, True, False, SOFT_CAP, PAD_D, PRECISION)

    acc = acc * v_scale  # 1.0 unless the cache is FP8
    if SPLIT:  # partial rows: seq * BLOCK_Q + tok for short rows, the token row for long
        part_row = (seq * BLOCK_Q + tok).to(tl.int64) if PER_SEQ else row_t
        idx = (part_row * num_heads + head) * num_splits + split
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (row_t * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, part_row, t, h, num_heads,
               num_splits, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_S: tl.constexpr):
    """out[t, h] from the splits' partial (max, sum, acc) of partial row part_row."""
    base = (part_row * num_heads + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    s_ok = offs_s < num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, cu_q_ptr, num_heads, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Short rows: program (seq * BLOCK_Q + tok, head)."""
    row = tl.program_id(0)  # seq * BLOCK_Q + tok
    h = tl.program_id(1)
    seq = row // BLOCK_Q
    tok = row % BLOCK_Q
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if (tok >= q_len) | (q_len > BLOCK_Q):
        return
    _merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, row.to(tl.int64),
               (q_start + tok).to(tl.int64), h, num_heads, num_splits, stride_ot, stride_oh,
               HEAD_DIM, BLOCK_D, BLOCK_S)


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_q_len"])
def _merge_long_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, cu_q_ptr, num_seqs, num_heads, num_splits,
    min_q_len, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Long rows: program (query block, head), as the attention kernel's, over its tokens;
    partial rows are token rows."""
    h = tl.program_id(1)
    _, q_start, q_len, q_tok0 = _long_block(cu_q_ptr, num_seqs, tl.program_id(0), BLOCK_Q)
    if (q_tok0 >= q_len) | (q_len < min_q_len):
        return
    for i in range(0, tl.minimum(BLOCK_Q, q_len - q_tok0)):
        t = (q_start + q_tok0 + i).to(tl.int64)
        _merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, t, t, h, num_heads,
                   num_splits, stride_ot, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=8)
def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@dataclass(frozen=True)
class Config:
    block_m: int  # query rows (tokens x group heads) per program
    tile_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int


WIDE = 256  # head sizes past this take wide_config's tiles


def wide_config(group: int) -> Config:
    """Heads wider than WIDE (latent attention's 576, padded to 1024 lanes): the group's rows
    (at least 16) over 16-key tiles, one stage, so that [rows, 1024] float32 accumulators
    and the K and V tiles fit a program (32 KB a tile in 16 bits). Not tuned; a latent
    cache's kernel of its own (the latent's 512 and the rope part's 64 as two dot
    products, vLLM's MLA layout) would not pad."""
    return Config(max(16, triton.next_power_of_2(group)), 16, 8, 1)


def short_config(group: int, fp8: bool = False, head_dim: int = 128) -> Config:
    if head_dim > WIDE:
        return wide_config(group)
    # memory-bound: deeper pipelines only hold more tiles in flight (2 stages beat 3 on bf16);
    # an FP8 tile holds half the bytes, so FP8 takes twice the keys and one more stage to keep
    # as many bytes in flight (benchmarks/kernels/bench_fp8_kv.py --sweep)
    if fp8:
        return Config(max(16, triton.next_power_of_2(group)), 128, 4, 3)
    return Config(max(16, triton.next_power_of_2(group)), 64, 4, 2)


def long_config(max_query_len: int, group: int, dtype: torch.dtype, head_dim: int = 128,
                hopper: bool = False, fp8_cache: bool = False) -> Config:
    if head_dim > WIDE:
        return wide_config(group)
    if dtype == torch.float32 and head_dim > 128:
        # fp32 tiles 256 lanes wide: of the 64/128-row configs only 64 rows x 32 keys fit in
        # H200's 227 KB of shared memory (64 x 64 keys needs 320 KB)
        return Config(max(64, triton.next_power_of_2(group)), 32, 4, 2)
    if hopper and not fp8_cache and dtype in (torch.bfloat16, torch.float16) \
            and head_dim <= 128 and max_query_len * group >= 256 and group <= 256:
        # 256 query rows, 16 warps: each K/V tile is read once for twice the rows. On an H100
        # at 1 x 8k, 4 x 4k and 1 x 32k (head 128, GQA 4) 9-14 % under the 128-row config's
        # time (bench_kernels.py's prefill_sweep, 2026-12-06); 64 KB of Q and 3 stages of K/V
        # tiles take 160 KB of the 227 KB of shared memory an sm_90 SM has. Not swept over an
        # FP8 cache (its tiles widen in registers), which keeps the 128-row config
        return Config(256, 64, 16, 3)
    block_m = max(64 if max_query_len * group <= 64 else 128, triton.next_power_of_2(group))
    return Config(block_m, 64, 8 if block_m >= 128 else 4, 2 if dtype == torch.float32 else 3)


def _pick_num_splits(programs: int, device: torch.device, max_seq_len: int, tile_n: int) -> int:
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    want = triton.next_power_of_2(triton.cdiv(target, programs))
    most = max(1, triton.cdiv(max_seq_len, 4 * tile_n))  # keep >= 4 tiles per split
    return max(1, min(want, most, MAX_AUTO_SPLITS))


def _auto_splits(programs: int, cfg: Config, group: int, device: torch.device,
                 seq_lens: torch.Tensor, max_seq_len: int | None,
                 sliding_window: int) -> tuple[int, int | None]:
    """Context splits for a launch of `programs` programs (1 when they fill the device), and
    the longest context, read from seq_lens (a host sync) only when it is needed and not
    given."""
    if programs >= 2 * _num_sms(device):
        return 1, max_seq_len
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    seen = max_seq_len  # keys a row reads: a window's worth at most
    if sliding_window:
        seen = min(seen, sliding_window + cfg.block_m // group + cfg.tile_n)
    return _pick_num_splits(programs, device, seen, cfg.tile_n), max_seq_len


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> None:
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    check_tensor("k_cache", k_cache, 4, (q.dtype, FP8_KV_DTYPE), dev)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), dev)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_inner_contiguous(name, t)
    _, _, hkv, d = k_cache.shape
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {d}")
    if not 16 <= d <= 1024 or d % 8:
        raise ValueError(f"head_dim must be a multiple of 8 in 16..1024, got {d}")
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
    num_long_splits: int | None = None,  # the same for the long rows' launch
    out: torch.Tensor | None = None,  # [T, H, D], q's dtype
    k_scale: float = 1.0,  # FP8 caches only: keys read as stored * k_scale
    v_scale: float = 1.0,
    sliding_window: int = 0,  # > 0: the query at position i sees keys i - W < j <= i only
    logits_soft_cap: float = 0.0,  # > 0: scores become cap * tanh(score / cap)
    sinks: torch.Tensor | None = None,  # [H] float: a logit a head in the softmax, no value
) -> torch.Tensor:
    """Same contract as kernels.reference.paged_attention.

    Rows of q past cu_seqlens_q[-1] (padding) are left unspecified in the output.
    """
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    check_attention_options(sliding_window, logits_soft_cap)
    check_sinks(sinks, q)
    if sinks is not None:  # one pointer type, one compiled variant, whatever the model's dtype
        sinks = sinks.float().contiguous()
    if _recorded is not None:
        _recorded.add(Signature.of(q, k_cache, sliding_window, logits_soft_cap, sinks))
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
    short = short_config(group, k_cache.dtype == FP8_KV_DTYPE, q.shape[2])
    if num_splits is None:
        num_splits, max_seq_len = _auto_splits(num_seqs * num_kv_heads, short, group, q.device,
                                               seq_lens, max_seq_len, sliding_window)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if k_cache.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    elif not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"FP8 KV scales must be > 0, got k_scale {k_scale}, v_scale {v_scale}")
    args = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)
    opts = {"k_scale": k_scale, "v_scale": v_scale, "sliding_window": int(sliding_window),
            "logits_soft_cap": float(logits_soft_cap), "sinks": sinks}
    launch(*args, short, per_seq=True, num_splits=num_splits, **opts)
    short_q = short.block_m // group
    if max_query_len <= short_q:
        return out
    if sinks is None and hopper.available(q, k_cache) and hopper.chosen(
            max_query_len, max_seq_len, k_cache.dtype == FP8_KV_DTYPE):  # (it takes no sinks)
        # TMA + wgmma on sm_90 where it is the faster (from hopper.MIN_KEYS keys)
        _hopper_long(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out,
                     min_q_len=short_q + 1, max_seq_len=max_seq_len, num_splits=num_long_splits,
                     sliding_window=int(sliding_window), logits_soft_cap=float(logits_soft_cap),
                     k_scale=k_scale, v_scale=v_scale)
        return out
    cfg = long_config(max_query_len, group, q.dtype, q.shape[2], hopper=_is_hopper(q.device),
                      fp8_cache=k_cache.dtype == FP8_KV_DTYPE)
    if num_long_splits is None:
        # a chunk of a long prompt has few query blocks (512 tokens of the 8B: 16 x 8 KV
        # heads = 128 programs on 132 SMs, each walking 128k keys): split its keys too.
        # The partials take at most ~2 x SMs x BLOCK_M x head_dim floats (35 MB at 128),
        # in steps of at most ~2 x SMs x BLOCK_Q / KV heads tokens: far inside the memory
        # the profile's largest step measured.
        programs = (num_tokens // (cfg.block_m // group) + 1) * num_kv_heads
        num_long_splits, _ = _auto_splits(programs, cfg, group, q.device, seq_lens,
                                          max_seq_len, sliding_window)
    if num_long_splits < 1:
        raise ValueError(f"num_long_splits must be >= 1, got {num_long_splits}")
    launch(*args, cfg, per_seq=False, num_splits=num_long_splits, min_q_len=short_q + 1, **opts)
    return out


def _hopper_long(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale: float,
                 out: torch.Tensor, *, min_q_len: int, max_seq_len: int | None,
                 num_splits: int | None, sliding_window: int, logits_soft_cap: float,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The long rows on the Hopper kernel, its keys split (and merged here) when its
    programs alone would leave the last wave of SMs mostly idle (hopper.num_splits)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    cfg = hopper.config_for(head_dim)
    block_q = cfg.block_m // (num_heads // num_kv_heads)
    grid0 = num_tokens // block_q + num_seqs
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        seen = min(max_seq_len, sliding_window + block_q) if sliding_window else max_seq_len
        num_splits = hopper.num_splits(grid0 * num_kv_heads, _num_sms(q.device),
                                       triton.cdiv(seen, cfg.tile_n))
    if num_splits < 1:
        raise ValueError(f"num_long_splits must be >= 1, got {num_splits}")
    opts = {"min_q_len": min_q_len, "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap, "num_splits": num_splits, "k_scale": k_scale,
            "v_scale": v_scale}
    args = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)
    if num_splits == 1:
        hopper.launch_long(*args, **opts)
        return
    # splits come with few programs, so with few tokens: at most ~10 waves of programs x
    # BLOCK_Q tokens / KV heads x the heads x head_dim floats (~90 MB at the 8B's shapes), far
    # under the activations of the profile's largest step, which sized the KV cache
    part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                         device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=q.device)
    hopper.launch_long(*args, partials=(part_m, part_l, part_acc), **opts)
    _merge_long_splits_kernel[(grid0, num_heads)](
        part_m, part_l, part_acc, out, cu_seqlens_q, num_seqs, num_heads, num_splits,
        min_q_len, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_Q=block_q,
        BLOCK_S=merge_width(num_splits))


def merge_width(num_splits: int) -> int:
    """The merge kernels' split lanes (BLOCK_S): two widths, not one a power of two, so
    warm_up_variants compiles every merge a serving step can launch (a width first met in a
    step compiled there, ~1 s with every stream waiting)."""
    return 8 if num_splits <= 8 else max(MAX_AUTO_SPLITS, triton.next_power_of_2(num_splits))


def launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale: float,
           out: torch.Tensor, cfg: Config, *, per_seq: bool, num_splits: int = 1,
           min_q_len: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
           sliding_window: int = 0, logits_soft_cap: float = 0.0,
           sinks: torch.Tensor | None = None) -> None:
    """One launch with an explicit config over checked arguments (benchmarks sweep this).

    per_seq=True handles only sequences with q_len <= cfg.block_m // group; per_seq=False
    handles only sequences with q_len >= min_q_len. Either may split the context over
    num_splits programs, merged after. sliding_window, logits_soft_cap and sinks as
    paged_attention's (0 or None: off); sinks contiguous float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_q = cfg.block_m // group
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        rows = num_seqs * block_q if per_seq else num_tokens
        part_m = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    grid0 = num_seqs if per_seq else num_tokens // block_q + num_seqs
    _paged_attn_kernel[(grid0, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
        out, part_m, part_l, part_acc, out if sinks is None else sinks,
        scale * _LOG2E * k_scale, float(v_scale), num_seqs, num_heads, num_splits, min_q_len,
        int(sliding_window), float(logits_soft_cap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, PER_SEQ=per_seq,
        SPLIT=split, WIDEN_F16=k_cache.dtype == FP8_KV_DTYPE and q.dtype == torch.bfloat16,
        PAD_D=block_d != head_dim, HAS_WINDOW=sliding_window > 0, SOFT_CAP=logits_soft_cap > 0,
        HAS_SINKS=sinks is not None,
        # float32 (a check mode): exact dots, as torch's float32 matmuls; tf32 would make a
        # verification row's logits differ from a decode row's where two nearly tie
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split and per_seq:
        _merge_splits_kernel[(num_seqs * block_q, num_heads)](
            part_m, part_l, part_acc, out, cu_seqlens_q, num_heads, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_Q=block_q,
            BLOCK_S=merge_width(num_splits),
        )
    elif split:
        _merge_long_splits_kernel[(grid0, num_heads)](
            part_m, part_l, part_acc, out, cu_seqlens_q, num_seqs, num_heads, num_splits,
            min_q_len, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_Q=block_q,
            BLOCK_S=merge_width(num_splits),
        )


# --------------------------------------------------------------------------- warm-up
@dataclass(frozen=True)
class Signature:
    """What decides a paged_attention call's compiled variants besides its shapes' sizes: a
    layer kind of a model (a Gemma has two, its sliding and its global layers)."""

    dtype: torch.dtype
    num_heads: int
    head_dim: int
    cache_dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    window: bool
    soft_cap: bool
    device: torch.device
    sinks: bool = False  # (last, with a default: the signatures built before it still build)

    @classmethod
    def of(cls, q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int,
           logits_soft_cap: float, sinks: torch.Tensor | None = None) -> Signature:
        return cls(q.dtype, q.shape[1], q.shape[2], k_cache.dtype, k_cache.shape[1],
                   k_cache.shape[2], sliding_window > 0, logits_soft_cap > 0, q.device,
                   sinks is not None)


_recorded: set[Signature] | None = None


@contextlib.contextmanager
def recording() -> Iterator[set[Signature]]:
    """The signatures of the paged_attention calls made inside (the executor's warm-up
    forwards), for warm_up_variants."""
    global _recorded
    outer, _recorded = _recorded, set()
    try:
        yield _recorded
    finally:
        _recorded = outer


# the context splits that reach each compiled variant: none, and each merge width
_WARM_SPLITS = (1, 2, 16)


def warm_up_variants(sig: Signature) -> list[tuple]:
    """Launch every variant a call of this signature can compile, on a small scratch cache:
    short rows split or not, the long rows' configs (each block_m long_config gives some
    query length) split or not, the Hopper kernel's where it runs, and each merge width.
    Which variant a serving step takes depends on its rows, contexts and the device's SMs,
    so a long prompt's first chunks beside running decodes met variants that no warm-up
    forward had, and compiled them there: ~2 s with no stream served, on an H100. Returns
    the variants launched, as (rows, block_m, num_splits). With sinks the long rows always
    take the portable kernel, so the Hopper kernel's are not launched."""
    group = sig.num_heads // sig.num_kv_heads
    keys = 2048  # 16 splits of the Hopper kernel's 128-key tiles: one tile each
    blocks = -(-keys // sig.block_size)
    dev = sig.device
    k_cache = torch.zeros((blocks, sig.block_size, sig.num_kv_heads, sig.head_dim),
                          dtype=sig.cache_dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    opts = {"sliding_window": 128 if sig.window else 0,
            "logits_soft_cap": 30.0 if sig.soft_cap else 0.0}
    if sig.sinks:
        opts["sinks"] = torch.zeros(sig.num_heads, dtype=torch.float32, device=dev)
    scale = sig.head_dim ** -0.5

    def rows(q_len: int) -> tuple:
        q = torch.zeros((q_len, sig.num_heads, sig.head_dim), dtype=sig.dtype, device=dev)
        tables = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
        lens = torch.tensor([keys], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
        return q, k_cache, v_cache, tables, lens, cu, scale, torch.empty_like(q)

    done: list[tuple] = []
    short = short_config(group, sig.cache_dtype == FP8_KV_DTYPE, sig.head_dim)
    for s in _WARM_SPLITS:
        launch(*rows(1), short, per_seq=True, num_splits=s, **opts)
        done.append((1, short.block_m, s))
    short_q = short.block_m // group
    configs: dict[Config, int] = {}
    for q_len in (short_q + 1, 64 // group + 1, 128 // group + 1, 256 // group + 1):
        q_len = max(q_len, short_q + 1)  # (long_config's block_m tiers, by q_len x group)
        cfg = long_config(q_len, group, sig.dtype, sig.head_dim, hopper=_is_hopper(dev),
                          fp8_cache=sig.cache_dtype == FP8_KV_DTYPE)
        configs.setdefault(cfg, q_len)
    for cfg, q_len in configs.items():
        for s in _WARM_SPLITS:
            launch(*rows(q_len), cfg, per_seq=False, num_splits=s, min_q_len=short_q + 1,
                   **opts)
            done.append((q_len, cfg.block_m, s))
    block_m = hopper.config_for(sig.head_dim).block_m
    q_len = max(short_q + 1, block_m // group)
    probe = rows(q_len)
    if not sig.sinks and hopper.available(probe[0], k_cache):
        for s in _WARM_SPLITS:
            _hopper_long(*probe, min_q_len=short_q + 1, max_seq_len=keys, num_splits=s,
                         **opts)
            done.append((q_len, block_m, s))
    return done
