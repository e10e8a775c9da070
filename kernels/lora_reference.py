"""Multi-LoRA in torch, punica's segment-grouped way (the CPU path and the test oracle of
kernels/lora.py).

A step's flat batch of T tokens is G segments (one a request: its tokens are contiguous), each
with one adapter slot or none (-1). For one LoRA-wrapped linear layer of a step:

    x          [T, H_in]     activations (fp32/bf16/fp16)
    a          [S, R, H_in]  lora_A of the S loaded adapters (x's dtype); a rank below R is
                             padded with zero rows
    b          [S, H_out, R] lora_B, the scaling folded in (y's dtype); zero columns past a rank
    seg_starts [G + 1] int32 non-decreasing, seg_starts[0] == 0, seg_starts[G] == T; segment g
                             is tokens [seg_starts[g], seg_starts[g + 1]), empty ones allowed
    seg_slots  [G] int32     each in [-1, S); -1: no adapter

    lora_shrink   t[tok] = x[tok] @ a[slot].T, float32            t: [T, R]
    lora_expand   y[tok, offset:offset + H_out] += (t[tok] @ b[slot].T).to(y.dtype)

Gathered (punica's indexed form): with `rows` [T] (int32/int64, distinct, each a row of x and
y), the segments run over the T positions of rows, position p standing for row rows[p] of x and
y: shrink reads x[rows[p]] into t[p], expand adds t[p]'s delta into y[rows[p]]. A layer then
applies the adapters to the rows that have one, grouped by slot, with no copy of x or of the
delta (rows must be distinct: expand's adds into y do not combine).

A fused projection (qkv, gate_up) of P parts (P <= 3) runs as one shrink and one expand: its
parts' A stacked along the rank (a [S, P * R, H_in], t [T, P * R]) and their B along the output
(b [S, H_out, R], H_out the parts' columns summed); expand's `parts` (the P column counts) makes
part p's columns take t's columns p * R .. (p + 1) * R.

Checks of shapes and dtypes live here for both paths; the values of seg_starts, seg_slots and
rows are checked here only (the Triton path never syncs with the host).
"""

from __future__ import annotations

import torch

from pagedserve.kernels._checks import FLOAT_DTYPES, check_inner_contiguous, check_out, check_tensor

MAX_RANK = 128  # R the Triton kernels hold in one tile (adapters in practice: ranks 8 to 64)
MAX_PARTS = 3  # parts of a fused projection (qkv)


def check_segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                   device: torch.device) -> int:
    """G of a valid [G + 1] / [G] pair of int32 tensors on device."""
    check_tensor("seg_starts", seg_starts, 1, (torch.int32,), device)
    check_tensor("seg_slots", seg_slots, 1, (torch.int32,), device)
    g = seg_slots.shape[0]
    if seg_starts.shape[0] != g + 1:
        raise ValueError(f"seg_starts has {seg_starts.shape[0]} entries, expected G + 1 = "
                         f"{g + 1} (seg_slots has G = {g})")
    return g


def check_rows(rows: torch.Tensor | None, device: torch.device, num_rows: int) -> None:
    if rows is not None:
        check_tensor("rows", rows, 1, (torch.int32, torch.int64), device)
        if rows.shape[0] > num_rows:
            raise ValueError(f"rows has {rows.shape[0]} entries, more than the {num_rows} rows "
                             f"they index (distinct rows)")


def check_shrink_args(x, a, seg_starts, seg_slots, out, rows=None) -> tuple[int, int, int, int]:
    """(T, H_in, S, R) of a valid lora_shrink call (T: the segments' positions, x's rows or
    rows'); anything else raises ValueError."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_inner_contiguous("x", x)
    dev, (t, h_in) = x.device, x.shape
    check_rows(rows, dev, t)
    t = t if rows is None else rows.shape[0]
    check_tensor("a", a, 3, (x.dtype,), dev)
    check_inner_contiguous("a", a)
    s, r, a_in = a.shape
    if a_in != h_in or not 1 <= r <= MAX_PARTS * MAX_RANK:
        raise ValueError(f"a {tuple(a.shape)} must be [S, R, {h_in}] (H_in: x's last dim), "
                         f"1 <= R <= {MAX_PARTS} x {MAX_RANK} (parts stacked)")
    check_segments(seg_starts, seg_slots, dev)
    check_out("out", out, (t, r), torch.float32, dev)
    return t, h_in, s, r


def check_expand_args(t, b, seg_starts, seg_slots, y, offset, rows=None, parts=None
                      ) -> tuple[int, int, int, int]:
    """(T, R, S, H_out) of a valid lora_expand call (R: a part's rank); anything else raises
    ValueError."""
    check_tensor("t", t, 2, (torch.float32,))
    check_inner_contiguous("t", t)
    dev, (num_tokens, t_r) = t.device, t.shape
    check_tensor("y", y, 2, FLOAT_DTYPES, dev)
    check_inner_contiguous("y", y)
    check_tensor("b", b, 3, (y.dtype,), dev)
    check_inner_contiguous("b", b)
    s, h_out, r = b.shape
    num_parts = 1 if parts is None else len(parts)
    if parts is not None and (not 1 <= num_parts <= MAX_PARTS or any(
            not isinstance(n, int) or n < 0 for n in parts) or sum(parts) != h_out):
        raise ValueError(f"parts {parts} must be 1 to {MAX_PARTS} column counts summing to "
                         f"b's H_out {h_out}")
    if t_r != num_parts * r or not 1 <= r <= MAX_RANK:
        raise ValueError(f"b {tuple(b.shape)} must be [S, H_out, R] with t's last dim {t_r} = "
                         f"{num_parts} part(s) x R (R: t's), 1 <= R <= {MAX_RANK}")
    check_segments(seg_starts, seg_slots, dev)
    check_rows(rows, dev, y.shape[0])
    if rows is not None and rows.shape[0] != num_tokens:
        raise ValueError(f"rows has {rows.shape[0]} entries, t {num_tokens} rows")
    if (rows is None and y.shape[0] != num_tokens) or not 0 <= offset <= y.shape[1] - h_out:
        raise ValueError(f"y {tuple(y.shape)} must be [{num_tokens}, N] (any rows with `rows`) "
                         f"with columns offset {offset} .. offset + H_out {h_out} inside N")
    return num_tokens, r, s, h_out


def segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor, num_tokens: int,
             num_slots: int) -> list[tuple[int, int, int]]:
    """[(start, end, slot)] of every segment, after checking the values (a host sync)."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens or any(
            lo > hi for lo, hi in zip(starts, starts[1:], strict=False)):
        raise ValueError(f"seg_starts {starts} must rise from 0 to T = {num_tokens}")
    if any(not -1 <= s < num_slots for s in slots):
        raise ValueError(f"seg_slots {slots} must lie in [-1, {num_slots})")
    return list(zip(starts, starts[1:], slots, strict=False))


def checked_rows(rows: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """rows as int64 after checking that they are distinct and in range (a host sync)."""
    if rows is None:
        return None
    rows = rows.long()
    if len(rows.unique()) != len(rows) or (len(rows) and (
            rows.min().item() < 0 or rows.max().item() >= num_rows)):
        raise ValueError(f"rows {rows.tolist()} must be distinct rows in [0, {num_rows})")
    return rows


def span(rows: torch.Tensor | None, lo: int, hi: int):
    """The rows of x / y that positions lo..hi stand for."""
    return slice(lo, hi) if rows is None else rows[lo:hi]


def lora_shrink(
    x: torch.Tensor,  # [T, H_in]
    a: torch.Tensor,  # [S, R, H_in] x.dtype
    seg_starts: torch.Tensor,  # [G + 1] int32
    seg_slots: torch.Tensor,  # [G] int32
    out: torch.Tensor,  # [T, R] float32, written
    rows: torch.Tensor | None = None,  # [T] rows of x (gathered), or None: x's rows are T
) -> None:
    """out[tok] = x[tok] @ a[slot].T in float32 (exact products of half inputs, float32 sums);
    rows of segments without an adapter are 0."""
    t, _, s, _ = check_shrink_args(x, a, seg_starts, seg_slots, out, rows)
    rows = checked_rows(rows, x.shape[0])
    out.zero_()
    for lo, hi, slot in segments(seg_starts, seg_slots, t, s):
        if slot >= 0 and hi > lo:
            out[lo:hi] = x[span(rows, lo, hi)].float() @ a[slot].float().T


def lora_expand(
    t: torch.Tensor,  # [T, R] float32
    b: torch.Tensor,  # [S, H_out, R] y.dtype
    seg_starts: torch.Tensor,  # [G + 1] int32
    seg_slots: torch.Tensor,  # [G] int32
    y: torch.Tensor,  # [T, N], N >= offset + H_out; updated in place
    offset: int,
    rows: torch.Tensor | None = None,  # [T] distinct rows of y (scattered), or None
    parts: tuple[int, ...] | None = None,  # P column counts summing to H_out, or None
) -> None:
    """y[tok, offset:offset + H_out] += (t[tok] @ b[slot].T).to(y.dtype), the product in
    float32; rows without an adapter and the other columns stay as they are. With parts, part
    p's columns take t's columns p * R .. (p + 1) * R."""
    num_tokens, r, s, h_out = check_expand_args(t, b, seg_starts, seg_slots, y, offset, rows,
                                                parts)
    rows = checked_rows(rows, y.shape[0])
    for lo, hi, slot in segments(seg_starts, seg_slots, num_tokens, s):
        if slot >= 0 and hi > lo:
            col = offset
            for p, n in enumerate(parts or (h_out,)):
                b_p = b[slot, col - offset:col - offset + n].float()  # [n, R]
                delta = t[lo:hi, p * r:(p + 1) * r] @ b_p.T  # [hi - lo, n]
                y[span(rows, lo, hi), col:col + n] += delta.to(y.dtype)
                col += n
