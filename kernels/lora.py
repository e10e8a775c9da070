"""Multi-LoRA shrink and expand, punica's segment-grouped GEMMs (layout and math:
kernels/lora_reference.py).

    lora_shrink   t[tok] = x[tok] @ a[slot].T             [T, R] float32
    lora_expand   y[tok, offset:offset + H_out] += (t[tok] @ b[slot].T).to(y.dtype)

Tiles. Each segment's rows are cut into BLOCK_M-row tiles of its own, numbered in segment
order, so one tile holds one adapter and one weight tile serves all its rows. A step has at
most (T + G * (BLOCK_M - 1)) // BLOCK_M of them (each segment wastes at most BLOCK_M - 1 rows),
a number of shapes only: the grid is that bound (times column blocks, times K splits), so a
captured CUDA graph replays right for any segment lengths, and no program is spent on a
(segment, row block) pair that cannot exist: decode's T one-token segments launch exactly T
tiles of 16 rows, prefill's few long segments about T / 64 tiles of 64. A program finds its
segment from seg_starts itself (a prefix sum of the tiles per segment, in registers: no extra
launch, no host sync); those past the last tile exit at once.

Shrink reads a whole adapter per tile (R x H_in) and its K loop is long (H_in up to ~28k), so
when there are few tiles (a small decode batch) K is split across programs that add into out
with float32 atomics (out zeroed first; the sum's order then varies from run to run by a few
ulps). Expand's K is the rank: one tl.dot per tile, float32 t against b widened to float32
(tf32 on the tensor cores for half y), the delta rounded to y's dtype and added as torch's
`+=` does.

Gathered: with `rows`, a position's x row is read from rows (shrink) and its delta added into
y's row rows[pos] (expand), so the executor runs a step's adapter tokens grouped by slot (one
segment per adapter: decode reads each adapter once, not once per token) straight from the
layer's input and into its output, without copies (executor_svc/lora.py).

Cost (H200, rank 64, bf16, 4096 -> 4096, one segment per token: the worst case): 256 one-token
segments 71 us shrink + 58 us expand; one 8192-token segment 68 + 127 us, about a quarter of HBM
bandwidth. benchmarks/kernels/bench_lora.py times them beside the GEMMs they ride on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from pagedserve.kernels.lora_reference import check_expand_args, check_shrink_args

TARGET_PROGRAMS = 256  # about two waves of an H200's 132 SMs: shrink splits K below that
MIN_K_PER_SPLIT = 512  # columns of x a shrink program reads at least
R_CHUNK = 64  # shrink's columns of out per program (a fused projection's stacked ranks: more)
# Triton's CPU interpreter (3.9) multiplies bf16 tiles as their raw 16-bit patterns in tl.dot
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def block_m_for(num_tokens: int, num_segs: int) -> int:
    """Rows per tile from the mean segment length (shapes only): decode's one-token segments
    waste least in 16-row tiles (tl.dot's smallest), prefill's long ones reuse each weight tile
    over 64 rows."""
    mean = num_tokens / max(num_segs, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def max_tiles(num_tokens: int, num_segs: int, block_m: int) -> int:
    """Tiles of any segmentation of T tokens into G segments: sum of ceil(len / BLOCK_M)."""
    return (num_tokens + num_segs * (block_m - 1)) // block_m


@triton.jit
def _find_tile(starts_ptr, num_segs, tile, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """(segment, first row, end row) of tile number `tile`, segment -1 past the last tile:
    a running prefix sum of ceil(len / BLOCK_M) over the segments, CHUNK at a time."""
    seg = -1
    row0 = 0
    end = 0
    before = 0  # tiles of the segments before this chunk
    for c in range(0, num_segs, CHUNK):
        g = c + tl.arange(0, CHUNK)
        ok = g < num_segs
        lo = tl.load(starts_ptr + g, mask=ok, other=0)
        hi = tl.load(starts_ptr + g + 1, mask=ok, other=0)
        n = (hi - lo + BLOCK_M - 1) // BLOCK_M  # 0 for empty segments and lanes past G
        last = before + tl.cumsum(n, 0)  # tiles up to and including each segment
        hit = (last - n <= tile) & (tile < last)  # one lane of one chunk, or none
        seg += tl.sum(tl.where(hit, g + 1, 0), 0)
        row0 += tl.sum(tl.where(hit, lo + (tile - last + n) * BLOCK_M, 0), 0)
        end += tl.sum(tl.where(hit, hi, 0), 0)
        before += tl.sum(n, 0)
    return seg, row0, end


@triton.jit(do_not_specialize=["num_segs", "h_in", "split_k"])
def _shrink_kernel(
    x_ptr, a_ptr, starts_ptr, slots_ptr, out_ptr, rows_ptr, num_segs, h_in, rank, split_k,
    stride_x, stride_as, stride_ar, stride_o,
    ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, R_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    GATHER: tl.constexpr,
):
    """out[pos, r-chunk] (+)= x[row, k-split] @ a[slot][r-chunk, k-split].T for one tile's
    positions (row: rows[pos] when GATHER, else pos); the rank in chunks of R_PAD (grid axis
    2: a fused projection's parts stacked)."""
    seg, row0, end = _find_tile(starts_ptr, num_segs, tl.program_id(0), BLOCK_M, CHUNK)
    if seg < 0:
        return
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    offs_r = tl.program_id(2) * R_PAD + tl.arange(0, R_PAD)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + offs_r[None, :]
    out_ok = row_ok[:, None] & (offs_r < rank)[None, :]
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    if slot < 0:  # no adapter: zeros (a split launch zeroed out beforehand)
        if not ATOMIC:
            tl.store(out_ptrs, acc, mask=out_ok)
        return
    span = tl.cdiv(tl.cdiv(h_in, split_k), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * span
    k_hi = tl.minimum(k_lo + span, h_in)
    offs_k = tl.arange(0, BLOCK_K)
    if GATHER:
        x_rows = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        x_rows = rows.to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_x + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    a_ptrs = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None]  # [K, R]
    r_ok = (offs_r < rank)[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = offs_k < k_hi - k0
        xt = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptrs + k0, mask=k_ok[:, None] & r_ok, other=0.0)
        if DOT_FP32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=out_ok, sem="relaxed")
    else:
        tl.store(out_ptrs, acc, mask=out_ok)


def lora_shrink(
    x: torch.Tensor,  # [T, H_in]
    a: torch.Tensor,  # [S, R, H_in] x.dtype, ranks below R padded with zero rows
    seg_starts: torch.Tensor,  # [G + 1] int32, from 0 up to T
    seg_slots: torch.Tensor,  # [G] int32 in [-1, S)
    out: torch.Tensor,  # [T, R] float32, written
    rows: torch.Tensor | None = None,  # [T] rows of x (gathered), or None: x's rows are T
) -> None:
    """out[tok] = x[tok] @ a[slot].T for tokens of segments with slot >= 0, 0 for the rest
    (x[rows[tok]] with rows)."""
    num_tokens, h_in, _, rank = check_shrink_args(x, a, seg_starts, seg_slots, out, rows)
    num_segs = seg_slots.shape[0]
    if num_tokens == 0:
        return
    block_m = block_m_for(num_tokens, num_segs)
    tiles = max_tiles(num_tokens, num_segs, block_m)
    r_pad = min(R_CHUNK, max(16, triton.next_power_of_2(rank)))
    chunks = triton.cdiv(rank, r_pad)
    cfg = shrink_config(block_m, tiles * chunks, h_in)
    split = cfg.pop("SPLIT_K")  # a run-time argument: one compiled variant for every split > 1
    if split > 1:
        out.zero_()
    _shrink_kernel[(tiles, split, chunks)](
        x, a, seg_starts, seg_slots, out, seg_starts if rows is None else rows, num_segs, h_in,
        rank, split,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0), ATOMIC=split > 1,
        BLOCK_M=block_m, R_PAD=r_pad, CHUNK=min(1024, max(16, triton.next_power_of_2(num_segs))),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and x.dtype != torch.float32, GATHER=rows is not None, **cfg)


# Launch configs measured per shape (benchmarks/kernels/bench_lora.py --tune writes them):
# {"shrink": {"BLOCK_M,H_in": {target_programs, BLOCK_K, num_warps}},
#  "expand": {"BLOCK_M,widest part": {BLOCK_N, num_warps}}}; shapes not there take the defaults
CONFIG_FILE = Path(__file__).with_name("lora_configs.json")
CONFIGS: dict[str, dict[str, dict]] = (json.loads(CONFIG_FILE.read_text())
                                       if CONFIG_FILE.exists() else {})


def shrink_config(block_m: int, programs: int, h_in: int) -> dict:
    """SPLIT_K, BLOCK_K and num_warps of a shrink launch of `programs` (tiles x rank chunks)
    before K is split: K splits until about target_programs run (at least MIN_K_PER_SPLIT
    columns each)."""
    tuned = CONFIGS.get("shrink", {}).get(f"{block_m},{h_in}", {})
    target = tuned.get("target_programs", TARGET_PROGRAMS)
    return {"SPLIT_K": max(1, min(triton.cdiv(target, programs), h_in // MIN_K_PER_SPLIT)),
            "BLOCK_K": tuned.get("BLOCK_K", max(16, min(128 if block_m == 16 else 64,
                                                        triton.next_power_of_2(h_in)))),
            "num_warps": tuned.get("num_warps", 4)}


def expand_config(block_m: int, widest: int) -> dict:
    """BLOCK_N and num_warps of an expand launch whose widest part has `widest` columns."""
    tuned = CONFIGS.get("expand", {}).get(f"{block_m},{widest}", {})
    return {"BLOCK_N": tuned.get("BLOCK_N", max(16, min(64 if block_m == 16 else 128,
                                                        triton.next_power_of_2(widest)))),
            "num_warps": tuned.get("num_warps", 4)}


@triton.jit(do_not_specialize=["num_segs", "h_out", "n1", "n2"])
def _expand_kernel(
    t_ptr, b_ptr, starts_ptr, slots_ptr, y_ptr, rows_ptr, num_segs, h_out, n1, n2, rank,
    stride_t, stride_bs, stride_bn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr, SCATTER: tl.constexpr, PARTS: tl.constexpr,
):
    """y[row, cols] += (t[pos, part's ranks] @ b[slot][cols].T).to(y.dtype) for one tile's
    positions (row: rows[pos] when SCATTER, else pos) and one column block of one part (parts
    end at n1, n2, h_out; grid axis 1 runs over every part's blocks); y_ptr points at column
    `offset` already."""
    seg, row0, end = _find_tile(starts_ptr, num_segs, tl.program_id(0), BLOCK_M, CHUNK)
    if seg < 0:
        return
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    if slot < 0:
        return
    blk = tl.program_id(1)
    part, lo, hi = 0, 0, h_out
    if PARTS > 1:  # which part's columns this block covers (part p: columns ends[p-1]..ends[p])
        nb0 = tl.cdiv(n1, BLOCK_N)
        part = (blk >= nb0).to(tl.int32)
        lo = part * n1
        first = part * nb0  # the part's first block
        if PARTS > 2:
            nb1 = tl.cdiv(n2 - n1, BLOCK_N)
            in2 = (blk >= nb0 + nb1).to(tl.int32)
            part += in2
            lo = tl.where(in2 > 0, n2, lo)
            first += in2 * nb1
            hi = tl.where(part == 0, n1, tl.where(part == 1, n2, h_out))
        else:
            hi = tl.where(part == 0, n1, h_out)
        blk -= first
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < rank
    offs_n = lo + blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    tt = tl.load(t_ptr + rows.to(tl.int64)[:, None] * stride_t + part * rank + offs_r[None, :],
                 mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, R_PAD]
    bt = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                 mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [R_PAD, BLOCK_N]
    delta = tl.dot(tt, bt.to(tl.float32), input_precision=PRECISION)
    if SCATTER:
        y_rows = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        y_rows = rows.to(tl.int64)
    y_ptrs = y_ptr + y_rows[:, None] * stride_y + offs_n[None, :]
    y_ok = row_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=y_ok, other=0.0)
    delta = delta.to(y.dtype).to(tl.float32)  # torch's `y += delta.to(y.dtype)`: two roundings
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_ok)


def lora_expand(
    t: torch.Tensor,  # [T, P * R] float32 (lora_shrink's out)
    b: torch.Tensor,  # [S, H_out, R] y.dtype
    seg_starts: torch.Tensor,  # [G + 1] int32, from 0 up to T
    seg_slots: torch.Tensor,  # [G] int32 in [-1, S)
    y: torch.Tensor,  # [T, N], N >= offset + H_out; updated in place
    offset: int,
    rows: torch.Tensor | None = None,  # [T] distinct rows of y (scattered), or None
    parts: tuple[int, ...] | None = None,  # P <= 3 column counts summing to H_out, or None
) -> None:
    """y[tok, offset:offset + H_out] += (t[tok] @ b[slot].T).to(y.dtype) for tokens of segments
    with slot >= 0 (y[rows[tok]] with rows); other rows and columns untouched. With parts, part
    p's columns take t's columns p * R .. (p + 1) * R (a fused projection, one launch)."""
    num_tokens, rank, _, h_out = check_expand_args(t, b, seg_starts, seg_slots, y, offset, rows,
                                                   parts)
    num_segs = seg_slots.shape[0]
    if num_tokens == 0 or h_out == 0:
        return
    sizes = parts or (h_out,)
    block_m = block_m_for(num_tokens, num_segs)
    cfg = expand_config(block_m, max(sizes))
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))] + [h_out] * 2
    grid = (max_tiles(num_tokens, num_segs, block_m),
            sum(triton.cdiv(n, cfg["BLOCK_N"]) for n in sizes))
    _expand_kernel[grid](
        t, b, seg_starts, seg_slots, y[:, offset:], seg_starts if rows is None else rows,
        num_segs, h_out, ends[0], ends[1], rank,
        t.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, R_PAD=max(16, triton.next_power_of_2(rank)),
        CHUNK=min(1024, max(16, triton.next_power_of_2(num_segs))),
        PRECISION="ieee" if y.dtype == torch.float32 else "tf32", SCATTER=rows is not None,
        PARTS=len(sizes), **cfg)
