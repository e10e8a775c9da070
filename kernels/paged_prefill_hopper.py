"""Paged prefill attention for Hopper (sm_90) in Gluon: TMA loads of K/V pages, wgmma, the
softmax of one key tile overlapped with the P @ V product of the one before.

The long-row launch of paged_attention (kernels/paged_attention.py: prefill rows and chunks,
q_len above the short rows' block) done the way FlashAttention-3 does it on an H100/H200:

- **TMA from the paged cache, from a load warp of its own** (warp specialization). A key tile
  of TILE_N keys is TILE_N / BLOCK_SIZE pages (or a TILE_N slice of one larger page); each is
  one TMA box [BLOCK_SIZE, head_dim] at (block id x BLOCK_SIZE, kv head x head_dim) of the
  cache viewed as [blocks x BLOCK_SIZE, KV heads x head_dim], copied into its rows of the
  tile's shared buffer: no address math in the warps that multiply, NUM_STAGES tiles in
  flight, slots handed back and forth by mbarriers. Pages past the sequence's keys load from
  past the end of the view, which TMA fills with zeros (so one constant byte count per tile's
  barrier). The block-id loads and the barrier Triton places between two copies into one
  buffer stall only that warp.
- **wgmma** for S = Q K^T (Q and K from shared memory) and O += P V (P from registers, V from
  shared memory), fp32 accumulators.
- **Overlap** (FA3's intra-warpgroup pipelining): tile j's S is issued, then the previous
  tile's P V; the softmax of tile j runs while P V is in flight, and O is rescaled once it
  lands (not FA3's ping-pong: the two warpgroups meet at a barrier each tile). Tiles below
  the block's first query position need no causal mask (a loop of their own); tiles wholly
  before a sliding window are never read.
- GQA packing as the portable kernel: a program's BLOCK_M rows are BLOCK_M / GROUP tokens x
  the GROUP query heads of one KV head, so each K/V tile is read once per group.

Covers bf16 and fp16, head sizes 64, 128 and 256 (others: the portable kernel), sliding
windows, logit soft-capping and an FP8 (e4m3) cache: its 1-byte tiles travel by TMA and the
warpgroups that multiply widen each to fp16 in shared memory before its product (q and P in
fp16 too, as the portable kernel's WIDEN_F16); the scales go to S's scale and O (`auto`
takes it over an FP8 cache only where FP8_AUTO). float32 stays on the portable kernel
(`available`). A launch whose programs are too few to fill the GPU (a chunk deep in a long
prompt) splits each block's keys over program_id(2) (`num_splits`); each split writes its
(max, sum, O) partials for paged_attention to merge.

The default on sm_90 for launches over at least MIN_KEYS keys (`chosen`; on an H100 2026-12-06:
0.81-0.90 of cuDNN SDPA on contiguous K/V from 4k to 128k keys, the 128k-token prompt's TTFT
12.6 s against the portable kernel's 16.7 s; docs/kernels.md). PAGEDSERVE_PREFILL_KERNEL=hopper
or portable forces either. The portable kernel and kernels/reference.py remain the oracles
(tests/kernels/test_paged_prefill_hopper.py).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import triton

from pagedserve.kernels._checks import FP8_KV_DTYPE
from pagedserve.kernels._gluon import (
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# "auto" (or unset): this kernel for the long rows where it is available and the keys are at
# least MIN_KEYS; "hopper": wherever available; "portable": never
ENV = "PAGEDSERVE_PREFILL_KERNEL"
# keys below which the portable kernel's long rows are faster: at 16 x 1k a program walks ~4
# tiles and this kernel's set-up (barriers, the load warp, Q's load) is not paid back (0.91x
# the portable kernel's time on an H100); at 4 x 4k it is 1.05x faster, at 8k 1.13x, at 128k
# 1.12x (bench_kernels.py's prefill section, 2026-12-06)
MIN_KEYS = 4096
HEAD_DIMS = (64, 128, 256)
# whether `auto` takes this kernel over an FP8 cache (at MIN_KEYS keys and more, as a 16-bit
# one): its GPU tests pass on an H100 and it is 1.42-1.67x the portable kernel's speed there
# over an FP8 cache (328ad22: 1 x 8k 1.42 vs 2.02 ms, 4 x 4k 1.54 vs 2.07, 1 x 32k 21.0 vs
# 29.6, a 2k chunk over 128k keys 10.6 vs 17.6; bench_kernels.py's prefill_fp8 section)
FP8_AUTO = True
LOAD_REGS = triton.language.constexpr(40)  # the load warp's registers (setmaxnreg)
# registers a thread at launch: (8 + 4) warps x 32 x 168 fit the SM's 64K; setmaxnreg then
# moves the load warpgroup's spare registers to the two that multiply
MAXNREG = 168
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class HopperConfig:
    block_m: int = 128  # query rows (tokens x group heads) per program: wgmma's M
    tile_n: int = 128  # keys per tile: S's N, P V's K
    num_stages: int = 2  # K/V tiles in flight
    num_warps: int = 8  # two warpgroups, 64 rows each


def config_for(head_dim: int) -> HopperConfig:
    # shared memory: Q [128, D] + stages x (K + V) [TILE_N, D], 2 bytes each: 160 KB at D 128
    # (128-key tiles, 2 stages) of the 227 KB an sm_90 SM has. At D 256 the O accumulator
    # alone is 128 registers a thread: 64-key tiles spilled (40-148 bytes with a window and
    # a soft cap, benchmarks/kernels/sm90_build.py), 32-key tiles do not; 3 stages, 160 KB.
    if head_dim == 256:
        return HopperConfig(tile_n=32, num_stages=3)
    return HopperConfig()


@functools.lru_cache(maxsize=4)
def _warn_mode(mode: str) -> None:
    logging.getLogger(__name__).warning("%s=%r is not auto, hopper or portable: auto", ENV, mode)


def chosen(max_query_len: int, max_seq_len: int | None, fp8_cache: bool = False) -> bool:
    """Whether the long rows should take this kernel (where `available`), by ENV: the
    portable kernel below MIN_KEYS keys (max_seq_len; max_query_len when it is not known),
    and over an FP8 cache unless FP8_AUTO."""
    mode = os.environ.get(ENV, "") or "auto"
    if mode not in ("auto", "hopper", "portable"):
        _warn_mode(mode)  # a typo must not fail every prefill: auto, said once
        mode = "auto"
    if mode != "auto":
        return mode == "hopper"
    if fp8_cache and not FP8_AUTO:
        return False
    return (max_seq_len if max_seq_len is not None else max_query_len) >= MIN_KEYS


@functools.lru_cache(maxsize=8)
def _sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel can run these long rows: Gluon, an sm_90 GPU, bf16/fp16 q and a
    cache of q's dtype or FP8 (e4m3), head_dim 64/128/256, a contiguous cache whose block size
    divides the tile or is a multiple of it, and at most BLOCK_M query heads a KV head."""
    if gluon is None or not q.is_cuda or not _sm90(q.device):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype not in (q.dtype,
                                                                                FP8_KV_DTYPE):
        return False
    _, block_size, hkv, d = k_cache.shape
    cfg = config_for(d)
    return (d in HEAD_DIMS and k_cache.is_contiguous() and q.shape[1] // hkv <= cfg.block_m
            and (cfg.tile_n % block_size == 0 or block_size % cfg.tile_n == 0)
            and block_size >= 8)


if gluon is not None:

    @gluon.jit
    def _find_long_block(cu_q_ptr, num_seqs, qb, BLOCK_Q: gl.constexpr):
        """Query block qb of the long-row layout (cu_q[b] // BLOCK_Q + b is sequence b's first
        block): its sequence, first query row, query count and first token."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if gl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= qb:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = gl.load(cu_q_ptr + seq)
        q_len = gl.load(cu_q_ptr + seq + 1) - q_start
        q_tok0 = (qb - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        return seq, q_start, q_len, q_tok0

    @gluon.jit
    def _packed_rows(q_tok0, q_start, q_len, kvh, stride_t, stride_h, layout: gl.constexpr,
                     GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr):
        """A program's BLOCK_M packed rows (BLOCK_Q tokens x the GROUP heads of KV head kvh),
        in layout's rows: each row's element offset in q (or out) and whether it is a real
        row (a token of the sequence; a group that is not a power of two leaves rows over)."""
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        tok = q_tok0 + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        ok = (tok < q_len) & (rows < BLOCK_Q * GROUP)
        return (q_start + tok).to(gl.int64) * stride_t + head * stride_h, ok

    @gluon.jit
    def _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, q_tok0, q_start,
                        q_len, kvh, num_heads, num_splits, split, GROUP: gl.constexpr,
                        BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
        """One key split's (max, sum, unnormalised O) of each packed row, in the portable
        kernel's partial layout ([token, head, split] and [token, head, split, HEAD_DIM],
        float32), which paged_attention's merge reads."""
        ml_layout: gl.constexpr = m_i.type.layout
        rows = gl.arange(0, BLOCK_M, layout=ml_layout)
        tok = q_tok0 + rows // GROUP
        idx = ((q_start + tok).to(gl.int64) * num_heads + kvh * GROUP + rows % GROUP) \
            * num_splits + split
        ok = (tok < q_len) & (rows < BLOCK_Q * GROUP)
        gl.store(part_m_ptr + idx, m_i, mask=ok)
        gl.store(part_l_ptr + idx, l_i, mask=ok)
        acc_layout: gl.constexpr = acc.type.layout
        a_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        a_tok = q_tok0 + a_rows // GROUP
        a_idx = ((q_start + a_tok).to(gl.int64) * num_heads + kvh * GROUP + a_rows % GROUP) \
            * num_splits + split
        a_ok = (a_tok < q_len) & (a_rows < BLOCK_Q * GROUP)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        gl.store(part_acc_ptr + gl.expand_dims(a_idx * HEAD_DIM, 1) + gl.expand_dims(cols, 0),
                 acc, mask=gl.expand_dims(a_ok, 1))

    @gluon.jit
    def _tile_blocks(bt_row, tile, kv_end, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr,
                     BOX: gl.constexpr):
        """The block ids of tile `tile`'s boxes in one load (each thread holds them all); the
        boxes past kv_end get -1."""
        PAGES: gl.constexpr = TILE_N // BOX
        ids_layout: gl.constexpr = gl.BlockedLayout([PAGES], [32], [1], [0])
        key0 = tile * TILE_N + gl.arange(0, PAGES, layout=ids_layout) * BOX
        return gl.load(bt_row + key0 // BLOCK_SIZE, mask=key0 < kv_end, other=-1)

    @gluon.jit
    def _load_partition(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, empty, bt_row,
                        t_lo, t_hi, kv_end, kv_col, past_end, BLOCK_SIZE: gl.constexpr,
                        TILE_N: gl.constexpr, BOX: gl.constexpr, HEAD_DIM: gl.constexpr,
                        NUM_STAGES: gl.constexpr, KV_BYTES: gl.constexpr):
        """One warp: for each tile, wait for its slot to be released, then one TMA box per
        page of K and of V. Boxes past kv_end load from row past_end (zeros), so each tile's
        barrier expects a constant byte count. The next tile's block ids load ahead."""
        PAGES: gl.constexpr = TILE_N // BOX
        nbytes: gl.constexpr = TILE_N * HEAD_DIM * KV_BYTES  # K (V), every box counted
        pages = gl.arange(0, PAGES, layout=gl.BlockedLayout([PAGES], [32], [1], [0]))
        ids = _tile_blocks(bt_row, t_lo, kv_end, BLOCK_SIZE, TILE_N, BOX)
        for j in range(t_lo, t_hi):
            i = j - t_lo
            slot = i % NUM_STAGES
            ids_next = _tile_blocks(bt_row, j + 1, kv_end, BLOCK_SIZE, TILE_N, BOX)
            # mbarriers start with phase 1 complete: the first NUM_STAGES waits pass
            mbarrier.wait(empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)
            k_buf = k_bufs.index(slot)
            v_buf = v_bufs.index(slot)
            mbarrier.expect(k_ready.index(slot), nbytes)
            mbarrier.expect(v_ready.index(slot), nbytes)
            for p in gl.static_range(PAGES):
                blk = gl.sum(gl.where(pages == p, ids, gl.zeros_like(ids)), 0)
                row = gl.where(blk >= 0, blk * BLOCK_SIZE + (j * TILE_N + p * BOX) % BLOCK_SIZE,
                               past_end)
                tma_load(k_desc, [row, kv_col], k_ready.index(slot), k_buf.slice(p * BOX, BOX))
                tma_load(v_desc, [row, kv_col], v_ready.index(slot), v_buf.slice(p * BOX, BOX))
            ids = ids_next

    @gluon.jit
    def _stage_tile(src, dst, tile, kv_end, TILE_N: gl.constexpr, MASK: gl.constexpr,
                    num_warps: gl.constexpr):
        """A K or V tile in shared memory rewritten into dst (src itself for a 16-bit cache)
        in dst's dtype, the operand wgmma reads: an FP8 (e4m3) tile widened to fp16, as the
        portable kernel's WIDEN_F16 (exact). With MASK the rows at keys >= kv_end are zeroed:
        the tail of the sequence's last page holds whatever the block held before (P is 0
        there, but 0 x NaN is not)."""
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        if MASK:
            keys = tile * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, blocked))
        x = src.load(blocked).to(dst.dtype)
        if MASK:
            x = gl.where(gl.expand_dims(keys < kv_end, 1), x, gl.zeros_like(x))
        dst.store(x)
        fence_async_shared()  # before wgmma (the async proxy) reads it

    @gluon.jit
    def _scores(s, tile, q_pos, kv_end, qk_scale, window, soft_cap, s_layout: gl.constexpr,
                TILE_N: gl.constexpr, MASK: gl.constexpr, HAS_WINDOW: gl.constexpr,
                SOFT_CAP: gl.constexpr):
        """S in the log2 domain, capped and masked as the portable kernel's _attend_tile."""
        s = s * qk_scale
        if SOFT_CAP:  # c * tanh(x / c) as 2 * sigmoid(2u) - 1 (see paged_attention.py)
            u = gl.exp2(s * (-2.0 / soft_cap))
            s = (soft_cap * 1.4426950408889634) * (2.0 / (1.0 + u) - 1.0)
        if MASK:
            k_pos = tile * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
            kp = gl.expand_dims(k_pos, 0)
            qp = gl.expand_dims(q_pos, 1)
            keep = (kp <= qp) & (kp < kv_end)
            if HAS_WINDOW:
                keep = keep & (kp > qp - window)
            s = gl.where(keep, s, gl.full_like(s, float("-inf")))
        return s

    @gluon.jit
    def _softmax(s, m_i, l_i):
        """Online softmax of one tile's scores: new max, P, the old sum rescaled plus P's row
        sums, and alpha (the factor O must be rescaled by)."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), gl.zeros_like(m_new), m_new)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        return m_new, p, l_i, alpha

    @gluon.jit
    def _step(j, t_lo, p_prev, acc, m_i, l_i, q_smem, k_bufs, v_bufs, k_wide, v_wide, k_ready,
              v_ready, empty, q_pos, kv_end, qk_scale, window, soft_cap,
              s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
              BLOCK_M: gl.constexpr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              NUM_STAGES: gl.constexpr, MASK: gl.constexpr, HAS_WINDOW: gl.constexpr,
              SOFT_CAP: gl.constexpr, FP8: gl.constexpr, num_warps: gl.constexpr):
        """Tile j (> t_lo): its S issued, then tile j - 1's P V; tile j's softmax while P V
        runs; tile j - 1's slot released to the load warp; O rescaled. FP8: each tile widened
        to k_wide / v_wide just before its product (tile j - 1 is never the last, so its V
        needs no mask)."""
        i = j - t_lo
        slot = i % NUM_STAGES
        phase = (i // NUM_STAGES) & 1
        prev = (i - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), phase)
        if FP8:
            # both warpgroups' S of the tile before (read from k_wide) have been waited for
            thread_barrier()
            _stage_tile(k_bufs.index(slot), k_wide, j, kv_end, TILE_N, False, num_warps)
            thread_barrier()
            k_op = k_wide
        else:
            k_op = k_bufs.index(slot)
        s = warpgroup_mma(q_smem, k_op.permute((1, 0)),
                          gl.zeros([BLOCK_M, TILE_N], gl.float32, s_layout), use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(prev), ((i - 1) // NUM_STAGES) & 1)
        if FP8:
            _stage_tile(v_bufs.index(prev), v_wide, j - 1, kv_end, TILE_N, False, num_warps)
            thread_barrier()
            v_op = v_wide
        else:
            v_op = v_bufs.index(prev)
        acc = warpgroup_mma(p_prev, v_op, acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        s = _scores(s, j, q_pos, kv_end, qk_scale, window, soft_cap, s_layout, TILE_N, MASK,
                    HAS_WINDOW, SOFT_CAP)
        m_i, p, l_i, alpha = _softmax(s, m_i, l_i)
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        if MASK and not FP8:  # noqa: SIM102 (constexprs, then a runtime test)
            # a tile reaching past the keys: clean its V before its P V (next step)
            if (j + 1) * TILE_N > kv_end:
                mbarrier.wait(v_ready.index(slot), phase)
                _stage_tile(v_bufs.index(slot), v_bufs.index(slot), j, kv_end, TILE_N, True,
                            num_warps)
        return p, acc, m_i, l_i

    @gluon.jit
    def _compute_partition(q_smem, k_bufs, v_bufs, k_wide, v_wide, k_ready, v_ready, empty,
                           q_pos, t_lo, t_hi, t_win, t_full, kv_end, qk_scale, window, soft_cap,
                           s_layout: gl.constexpr, o_layout: gl.constexpr,
                           p_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                           TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr,
                           SOFT_CAP: gl.constexpr, FP8: gl.constexpr, num_warps: gl.constexpr):
        """The two warpgroups that multiply: O (unnormalised), the row maxima (log2 domain)
        and the row sums. FP8: K and V tiles are widened to fp16 (k_wide, v_wide) first."""
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        # the first tile, masked (it may hold the window's edge, the causal edge or both)
        mbarrier.wait(k_ready.index(0), 0)
        if FP8:
            _stage_tile(k_bufs.index(0), k_wide, t_lo, kv_end, TILE_N, False, num_warps)
            thread_barrier()
            k_op = k_wide
        else:
            k_op = k_bufs.index(0)
        s = warpgroup_mma(q_smem, k_op.permute((1, 0)),
                          gl.zeros([BLOCK_M, TILE_N], gl.float32, s_layout), use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = _scores(s, t_lo, q_pos, kv_end, qk_scale, window, soft_cap, s_layout, TILE_N,
                    True, HAS_WINDOW, SOFT_CAP)
        m_i, p, l_i, alpha = _softmax(s, m_i, l_i)
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        if not FP8:  # noqa: SIM102 (a constexpr; FP8 masks the V tiles as they widen)
            if (t_lo + 1) * TILE_N > kv_end:
                mbarrier.wait(v_ready.index(0), 0)
                _stage_tile(v_bufs.index(0), v_bufs.index(0), t_lo, kv_end, TILE_N, True,
                            num_warps)

        # the rest: the window's edge masked, then unmasked tiles, then the causal tail
        t_mid = gl.maximum(t_lo + 1, t_win)
        t_tail = gl.maximum(t_mid, t_full)
        for j in range(t_lo + 1, gl.minimum(t_mid, t_hi)):
            p, acc, m_i, l_i = _step(
                j, t_lo, p, acc, m_i, l_i, q_smem, k_bufs, v_bufs, k_wide, v_wide, k_ready,
                v_ready, empty, q_pos, kv_end, qk_scale, window, soft_cap, s_layout, o_layout,
                p_layout, BLOCK_M, TILE_N, HEAD_DIM, NUM_STAGES, True, HAS_WINDOW, SOFT_CAP, FP8,
                num_warps)
        for j in range(t_mid, gl.minimum(t_tail, t_hi)):
            p, acc, m_i, l_i = _step(
                j, t_lo, p, acc, m_i, l_i, q_smem, k_bufs, v_bufs, k_wide, v_wide, k_ready,
                v_ready, empty, q_pos, kv_end, qk_scale, window, soft_cap, s_layout, o_layout,
                p_layout, BLOCK_M, TILE_N, HEAD_DIM, NUM_STAGES, False, HAS_WINDOW, SOFT_CAP, FP8,
                num_warps)
        for j in range(t_tail, t_hi):
            p, acc, m_i, l_i = _step(
                j, t_lo, p, acc, m_i, l_i, q_smem, k_bufs, v_bufs, k_wide, v_wide, k_ready,
                v_ready, empty, q_pos, kv_end, qk_scale, window, soft_cap, s_layout, o_layout,
                p_layout, BLOCK_M, TILE_N, HEAD_DIM, NUM_STAGES, True, HAS_WINDOW, SOFT_CAP, FP8,
                num_warps)

        # the last tile's P V
        i_last = t_hi - 1 - t_lo
        mbarrier.wait(v_ready.index(i_last % NUM_STAGES), (i_last // NUM_STAGES) & 1)
        if FP8:
            thread_barrier()  # the P V before (from v_wide) waited for by both warpgroups
            _stage_tile(v_bufs.index(i_last % NUM_STAGES), v_wide, t_hi - 1, kv_end, TILE_N, True,
                   num_warps)
            thread_barrier()
            v_op = v_wide
        else:
            v_op = v_bufs.index(i_last % NUM_STAGES)
        acc = warpgroup_mma(p, v_op, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return acc, m_i, l_i

    # as the portable kernel's: step-varying ints are not specialised on (a compile while
    # serving stalls the step); past_end (the cache's rows) is fixed per run
    @gluon.jit(do_not_specialize=["num_seqs", "min_q_len", "window", "stride_bt", "num_splits"])
    def _prefill_kernel(
        q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, cu_q_ptr, out_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, num_heads, num_splits,
        qk_scale, v_scale, num_seqs, min_q_len, window, soft_cap, past_end,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr, SOFT_CAP: gl.constexpr,
        SPLIT: gl.constexpr, FP8: gl.constexpr, num_warps: gl.constexpr,
    ):
        BOX: gl.constexpr = k_desc.block_type.shape[0]  # keys a TMA box holds
        KV_DTYPE: gl.constexpr = k_desc.dtype
        # the products' operand type: q's, or fp16 over an FP8 cache (its tiles widen to it)
        DTYPE: gl.constexpr = gl.float16 if FP8 else KV_DTYPE
        KV_BYTES: gl.constexpr = KV_DTYPE.primitive_bitwidth // 8
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, TILE_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

        kvh = gl.program_id(1)
        # heaviest first (FA3's LPT order): a causal block's work grows with its position, so
        # the blocks are taken last to first and the short ones fill the final wave
        qb = gl.num_programs(0) - 1 - gl.program_id(0)
        seq, q_start, q_len, q_tok0 = _find_long_block(cu_q_ptr, num_seqs, qb, BLOCK_Q)
        if (q_tok0 >= q_len) | (q_len < min_q_len):
            return
        ctx = gl.load(seq_lens_ptr + seq)
        first_pos = ctx - q_len + q_tok0
        kv_end = gl.minimum(ctx, first_pos + BLOCK_Q)  # keys any row of this block may see
        t_hi = gl.cdiv(kv_end, TILE_N)
        t_full = (first_pos + 1) // TILE_N  # tiles below need no causal or length mask
        if HAS_WINDOW:
            t_lo = gl.maximum(first_pos - window + 1, 0) // TILE_N
            t_win = gl.cdiv(gl.maximum(kv_end - window, 0), TILE_N)  # from here: all inside
        else:
            t_lo = 0
            t_win = 0
        if SPLIT:  # the splits share out the block's tiles (a chunk deep in a long prompt)
            split = gl.program_id(2)
            per_split = gl.cdiv(t_hi - t_lo, num_splits)
            t_lo = t_lo + split * per_split
            t_hi = gl.minimum(t_lo + per_split, t_hi)
            if t_lo >= t_hi:  # no tile: weight 0 in the merge
                z_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
                _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr,
                                gl.full([BLOCK_M], float("-inf"), gl.float32,
                                        gl.SliceLayout(1, z_layout)),
                                gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, z_layout)),
                                gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, z_layout), q_tok0,
                                q_start, q_len, kvh, num_heads, num_splits, split, GROUP,
                                BLOCK_Q, BLOCK_M, HEAD_DIM)
                return

        # Q: BLOCK_Q tokens x GROUP heads, loaded once into shared memory
        q_off, row_ok = _packed_rows(q_tok0, q_start, q_len, kvh, stride_qt, stride_qh,
                                     q_blocked, GROUP, BLOCK_Q, BLOCK_M)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_blocked))
        q = gl.load(q_ptr + gl.expand_dims(q_off, 1) + gl.expand_dims(cols, 0),
                    mask=gl.expand_dims(row_ok, 1), other=0.0)
        if FP8:  # fp16 as the portable kernel's WIDEN_F16 (clamped to its range)
            q = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
        q_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_M, HEAD_DIM],
                                           gl.NVMMASharedLayout.get_default_for(
                                               [BLOCK_M, HEAD_DIM], DTYPE), q)
        fence_async_shared()

        k_bufs = gl.allocate_shared_memory(KV_DTYPE, [NUM_STAGES, TILE_N, HEAD_DIM],
                                           k_desc.layout)
        v_bufs = gl.allocate_shared_memory(KV_DTYPE, [NUM_STAGES, TILE_N, HEAD_DIM],
                                           v_desc.layout)
        if FP8:  # one widened K and V tile (each read by one product, then rewritten)
            wide_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [TILE_N, HEAD_DIM], gl.float16)
            k_wide = gl.allocate_shared_memory(gl.float16, [TILE_N, HEAD_DIM], wide_layout)
            v_wide = gl.allocate_shared_memory(gl.float16, [TILE_N, HEAD_DIM], wide_layout)
        else:  # unused
            k_wide = k_bufs
            v_wide = v_bufs
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(st), count=1)
            mbarrier.init(v_ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=1)
        bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
        q_pos = first_pos + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) // GROUP

        acc, m_i, l_i = gl.warp_specialize([
            (_compute_partition, (q_smem, k_bufs, v_bufs, k_wide, v_wide, k_ready, v_ready,
                                  empty, q_pos, t_lo, t_hi, t_win, t_full, kv_end, qk_scale,
                                  window, soft_cap, s_layout, o_layout, p_layout, BLOCK_M,
                                  TILE_N, HEAD_DIM, NUM_STAGES, HAS_WINDOW, SOFT_CAP, FP8,
                                  num_warps)),
            (_load_partition, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, empty, bt_row,
                               t_lo, t_hi, kv_end, kvh * HEAD_DIM, past_end, BLOCK_SIZE,
                               TILE_N, BOX, HEAD_DIM, NUM_STAGES, KV_BYTES)),
        ], [1], [LOAD_REGS])
        if FP8:
            acc = acc * v_scale  # V read as stored x v_scale
        for st in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_ready.index(st))
            mbarrier.invalidate(v_ready.index(st))
            mbarrier.invalidate(empty.index(st))

        if SPLIT:
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, q_tok0,
                            q_start, q_len, kvh, num_heads, num_splits, gl.program_id(2), GROUP,
                            BLOCK_Q, BLOCK_M, HEAD_DIM)
        else:
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            o = acc / gl.expand_dims(gl.where(l_o == 0.0, gl.full_like(l_o, 1.0), l_o), 1)
            o_off, o_ok = _packed_rows(q_tok0, q_start, q_len, kvh, stride_ot, stride_oh,
                                       o_layout, GROUP, BLOCK_Q, BLOCK_M)
            o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            gl.store(out_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(o_cols, 0),
                     o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(o_ok, 1))


def _layout(shape, dtype: torch.dtype):
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
           FP8_KV_DTYPE: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(shape, gdt)


def launch_long(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale: float,
                out: torch.Tensor, *, min_q_len: int, sliding_window: int = 0,
                logits_soft_cap: float = 0.0, config: HopperConfig | None = None,
                num_splits: int = 1,
                partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The long rows (q_len >= min_q_len) of paged_attention over checked arguments that
    `available` accepted; the other rows of out are left alone. An FP8 cache's keys and values
    read as stored x k_scale and x v_scale (ignored for a 16-bit cache). With num_splits > 1 each
    block's keys are split that many ways and the splits' (max, sum, O) go to partials
    (float32 [tokens, heads, splits] twice and [tokens, heads, splits, head_dim], the
    portable kernel's layout) for the caller to merge; out is not written."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    cfg = config or config_for(head_dim)
    group = num_heads // num_kv_heads
    block_q = cfg.block_m // group
    box = min(block_size, cfg.tile_n)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    if not fp8:
        k_scale = v_scale = 1.0
    layout = _layout([box, head_dim], k_cache.dtype)
    descs = [TensorDescriptor(c.view(num_blocks * block_size, num_kv_heads * head_dim),
                              [num_blocks * block_size, num_kv_heads * head_dim],
                              [num_kv_heads * head_dim, 1], [box, head_dim], layout)
             for c in (k_cache, v_cache)]
    num_seqs = seq_lens.shape[0]
    split = num_splits > 1
    if split and (partials is None or partials[2].shape != (num_tokens, num_heads, num_splits,
                                                            head_dim)):
        raise ValueError(f"{num_splits} key splits need partials [{num_tokens}, {num_heads}, "
                         f"{num_splits}(, {head_dim})]")
    part_m, part_l, part_acc = partials if split else (out, out, out)  # unused without splits
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads, num_splits)](
        q, descs[0], descs[1], block_tables, seq_lens, cu_seqlens_q, out,
        part_m, part_l, part_acc, num_heads, num_splits,
        scale * _LOG2E * k_scale, float(v_scale), num_seqs, min_q_len, int(sliding_window),
        float(logits_soft_cap),
        num_blocks * block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, NUM_STAGES=cfg.num_stages,
        HAS_WINDOW=sliding_window > 0, SOFT_CAP=logits_soft_cap > 0, SPLIT=split, FP8=fp8,
        num_warps=cfg.num_warps, maxnreg=MAXNREG)


MIN_TILES_PER_SPLIT = 8  # a split's set-up (Q, barriers, the pipeline's fill) paid back


def num_splits(programs: int, num_sms: int, tiles: int) -> int:
    """Key splits for a launch of `programs` blocks that each walk `tiles` key tiles, one
    program an SM at a time (160 KB of shared memory each): the fewest (a power of two) that
    fill 90 % of the last wave, else the fullest. A 512-token chunk at the end of a 128k
    prompt (8 KV heads): 136 programs on 132 SMs, two waves, the second 4 programs; 8 splits
    make 1,088 in 9 waves. Whole prompts make programs enough: 1."""
    best, best_fill, s = 1, 0.0, 1
    while s <= 64 and (s == 1 or tiles // s >= MIN_TILES_PER_SPLIT):
        waves = programs * s / num_sms
        fill = waves / math.ceil(waves)  # the share of the waves' slots used
        if fill >= 0.9:
            return s
        if fill > best_fill:
            best, best_fill = s, fill
        s *= 2
    return best
