"""W4A16 GEMM: out[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias), 4-bit weights dequantized in
registers, 16/32-bit activations, fp32 accumulation.

Internal packed layout (AWQ and GPTQ checkpoints are repacked into it at load time):

    qweight [K/8, N] int32   nibble j (bits 4j..4j+3) of word [i, n] is q[8i + j, n], 0..15
    scales  [ceil(K/G), N]   activation dtype
    zeros   [ceil(K/G), N]   activation dtype, integer-valued 0..15
    W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
    perm    [K] int32 or None  act-order: row k of W multiplies input channel perm[k], so groups
                               are contiguous rows; the launcher gathers x's columns once

Packing along K (like GPTQ, unlike AWQ's N-packing) puts 8 consecutive k of one output column
in a word: a [BLOCK_K/8, BLOCK_N] tile load is coalesced along N and unpacks with shifts by a
constant per k%8 (no gathers), and a K tile never straddles two groups when BLOCK_K divides G.
A last partial group (K % G != 0, e.g. K=576 at G=128) is allowed.

The nibble becomes a float without an int->float convert (a slow instruction): OR-ing it into
the mantissa of 2^23 gives 2^23 + q exactly, and subtracting (2^23 + z) gives q - z exactly, so
the kernel's W is bit-identical to the torch reference's before rounding to the activation dtype.

With bf16/fp16 activations on CUDA, the decode path goes further (dequant="x2planes", see
_X2_ASM): one lop3 turns two nibbles into a packed bf16x2/f16x2 pair, two packed fmas subtract
the zero and apply the scale (still bit-identical), and each of a word's eight nibble planes
[BLOCK_K/8, BLOCK_N] is multiplied by the matching stride-8 columns of x in its own tl.dot, so
the dequantized weight reaches the tensor cores without a trip through shared memory. Counted
by benchmarks/quant/sass_w4a16.py: 333 instead of 573 sm_90 instructions per K tile.

Paths (w4a16_gemm picks; on an sm_90 GPU kernels/w4a16_gluon.py takes most of 17-256 rows):
- decode (M <= 16): split-K; each program owns BLOCK_N columns and K/split rows, so a GEMV with
  few column tiles still fills the GPU. Partials go to fp32 [split, M, N], summed by the last
  program of each column tile (or a reduce kernel; split 1 writes out directly). Rows are
  reduced with tl.dot (16-row minimum) or, in fp32, with broadcast multiply-and-sum on the CUDA
  cores. H200: 1.30-1.54x of bf16 at 1-16 rows.
- tiled (17-64 rows; up to 128 on the wide gate_up/down shapes): one M tile of 32, 64 or 128
  rows, split-K with the same epilogue (one program per output tile ran ~1.4 us per K tile
  whatever its rows, so few tiles meant a slow GEMM), and swap-AB: out^T = W^T x^T makes the
  dequantized weight wgmma's register operand and x the shared-memory one. With a group size
  of 128 or more, `planes`: x is reordered plane-major within each 128 columns (plane_major),
  so each nibble plane of a tile multiplies 16 contiguous columns in its own dot and the
  packed words reach the operand layout without a reshape through shared memory (sm_90 loop:
  374 instructions, 2 barriers, no STS; the reshaped tile: 444, 5, 8). Triton still makes each
  of a tile's wgmmas wait for the previous one (their register operand is computed in the
  loop); the Gluon kernel does not. H200: 0.96-1.08x of bf16 at 32 rows, 0.64-0.94x at 64,
  0.61-0.62x at 128 on the big shapes.
- many rows (use_dequant_matmul): the weight is dequantized into a [K, N] scratch (one
  memory-bound pass, ~4.5 bytes moved per weight) and multiplied by torch.matmul: 0.57-0.74x of
  bf16 at 256 rows on the small shapes (where the Gluon kernel does not win). Doing it N columns
  at a time, for the scratch to stay in L2, was slower at every chunk size.
Numbers: benchmarks/results/w4a16_gemm_2026-11-30T045335.jsonl (final defaults, Gluon
included) and ..T042134 (plane-major sweep); benchmarks/NOTES.md has the sweeps behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from pagedserve.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_inner_contiguous,
    check_tensor,
)

_MAGIC = 8388608.0  # 2^23


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 0  # 0: derive from the shape so that about `target_programs` run
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    target_programs: int = 528  # 4 per SM on an H100/H200
    bcast_load: bool = False
    lock_reduce: bool = True  # split-K sum by the last program (one launch), else a 2nd kernel
    # "fp32": nibbles to fp32 by the 2^23 trick (runs everywhere, the interpreter included);
    # "x2": two nibbles per instruction into a packed bf16x2/f16x2 register by inline PTX,
    # reshaped to [BLOCK_K, BLOCK_N]; "x2planes": the same, one dot per nibble plane, no reshape
    dequant: str = "fp32"


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    bcast_load: bool = False
    dequant: str = "fp32"  # "fp32" or "x2" (see DecodeConfig.dequant)
    swap_ab: bool = False  # compute out^T = W^T x^T (the weight is the register operand)
    split_k: int = 1  # K parts per output tile, summed by the last program of each tile
    # one tl.dot per nibble plane against x in plane-major order (see plane_major): the
    # weight tile is never reshaped, so its words go from shared memory straight into the
    # tensor cores' operand layout. Needs BLOCK_K 128 (a group size >= 128), else ignored.
    planes: bool = False


DECODE_MAX_ROWS = 16
DEQUANT_MIN_ROWS = 64  # rows beyond which dequantize-then-cuBLAS wins (see use_dequant_matmul)


def _big(n: int, k: int) -> bool:
    """The Llama-3.1-8B gate_up and down shapes (N or K = 14336), not q/k/v/o."""
    return n * k > 32 * 1024 * 1024


def use_dequant_matmul(m: int, n: int, k: int) -> bool:
    """H200 sweeps (bf16, G=128, Llama-3.1-8B shapes): dequantize + cuBLAS wins beyond 128 rows,
    and beyond 64 on the small shapes; the split-K tiled kernel wins below
    (results/w4a16_gemm_2026-11-30T031054.jsonl, ..T042134.jsonl)."""
    return m > 2 * DEQUANT_MIN_ROWS or (m > DEQUANT_MIN_ROWS and not _big(n, k))


def _split_for(tiles: int, target: int, cap: int) -> int:
    """The smallest power-of-two split-K with at least `target` programs, at most `cap`."""
    split = 1
    while tiles * split < target and split < cap:
        split *= 2
    return split


@triton.jit
def _load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size):
    """The scales and zeros of the group holding row k0 (BLOCK_K divides group_size: one group
    per tile), in the activation dtype."""
    g = k0 // group_size
    s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
    z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)
    return s, z


@triton.jit
def _load_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BCAST_LOAD: tl.constexpr):
    """Rows k0..k0+BLOCK_K of W, dequantized: [BLOCK_K, BLOCK_N] float32."""
    s, z = _load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size)
    return _dequant_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, BLOCK_N, BCAST_LOAD)


@triton.jit
def _dequant_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BCAST_LOAD: tl.constexpr):
    """_load_tile with the tile's scales and zeros given."""
    if BCAST_LOAD:  # each word loaded by its 8 rows (L1 hits): no register reshuffle
        offs_k = tl.arange(0, BLOCK_K)
        k8 = k0 // 8 + offs_k // 8
        qw = tl.load(qw_ptr + k8[:, None] * N + offs_n[None, :],
                     mask=(k8 < K // 8)[:, None] & n_ok[None, :], other=0)
        q = (qw >> ((offs_k % 8) * 4)[:, None]) & 0xF
    else:  # each word loaded once, unpacked to [BLOCK_K/8, 8, BLOCK_N] and reshaped
        k8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        qw = tl.load(qw_ptr + k8[:, None] * N + offs_n[None, :],
                     mask=(k8 < K // 8)[:, None] & n_ok[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        q = tl.reshape((qw[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
    zb = z.to(tl.float32) + 8388608.0
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q, exactly
    return (qf - zb[None, :]) * s.to(tl.float32)[None, :]


# Eight nibbles of a word become four packed 16-bit pairs: (q >> 4i) & 0x000F000F sets nibbles
# i and i+4 as the low mantissa bits of two halves whose exponent is that of 128 (bf16) or
# 1024 (fp16), so each half reads 128 + q (1024 + q) exactly; one fma per pair subtracts
# (128 + z), exact, and one multiplies by the scale, one rounding: bit-identical to the fp32
# path rounded to the activation dtype. fma (not sub/mul.bf16x2, sm_90 only) keeps sm_80.
_X2_ASM = """{
.reg .b32 w, t0, t1, t2, t3, one, nz;
mov.b32 one, ONE;
mov.b32 nz, NEGZERO;
mov.b32 w, $8;
lop3.b32 t0, w, 0x000f000f, MAGIC, 0xea;
shr.u32 w, w, 4;
lop3.b32 t1, w, 0x000f000f, MAGIC, 0xea;
shr.u32 w, w, 4;
lop3.b32 t2, w, 0x000f000f, MAGIC, 0xea;
shr.u32 w, w, 4;
lop3.b32 t3, w, 0x000f000f, MAGIC, 0xea;
fma.rn.TY t0, t0, one, $9;
fma.rn.TY t1, t1, one, $9;
fma.rn.TY t2, t2, one, $9;
fma.rn.TY t3, t3, one, $9;
fma.rn.TY t0, t0, $10, nz;
fma.rn.TY t1, t1, $10, nz;
fma.rn.TY t2, t2, $10, nz;
fma.rn.TY t3, t3, $10, nz;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}"""


def x2_variants(asm: str) -> tuple[tl.constexpr, tl.constexpr]:
    """The bf16x2 and f16x2 versions of a packed-pair asm: TY, MAGIC (the exponent of 128,
    1024), ONE and NEGZERO filled in (also kernels/w4a16_gluon.py's _PAIR_ASM)."""
    fill = {"bf16x2": ("0x43004300", "0x3f803f80"), "f16x2": ("0x64006400", "0x3c003c00")}
    return tuple(tl.constexpr(asm.replace("TY", ty).replace("MAGIC", magic)
                              .replace("ONE", one).replace("NEGZERO", "0x80008000"))
                 for ty, (magic, one) in fill.items())


_X2_ASM_BF16, _X2_ASM_FP16 = x2_variants(_X2_ASM)


@triton.jit
def _pair(v):
    """16-bit floats (any shape) -> int32 words holding each twice (an operand of _X2_ASM)."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _load_planes_x2(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
                    BLOCK_K: tl.constexpr):
    """Rows k0..k0+BLOCK_K of W as eight [BLOCK_K/8, BLOCK_N] planes in the activation dtype:
    plane j holds rows k0 + 8i + j."""
    s, z = _load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size)
    return _tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, False, "x2")


@triton.jit
def _nibble_plane(qw, j: tl.constexpr, zb, sf):
    """fp32 plane j of packed words (the 2^23 trick of _dequant_tile)."""
    qf = (((qw >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    return (qf - zb) * sf


@triton.jit
def _tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K: tl.constexpr,
                 SWAP_AB: tl.constexpr, DEQUANT: tl.constexpr):
    """Rows k0..k0+BLOCK_K of W as eight planes, plane j holding rows k0 + 8i + j: [BLOCK_K/8,
    BLOCK_N], or [BLOCK_N, BLOCK_K/8] with SWAP_AB; packed pairs ("x2") or float32."""
    k8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if SWAP_AB:
        qw = tl.load(qw_ptr + k8[None, :] * N + offs_n[:, None],
                     mask=n_ok[:, None] & (k8 < K // 8)[None, :], other=0)
    else:
        qw = tl.load(qw_ptr + k8[:, None] * N + offs_n[None, :],
                     mask=(k8 < K // 8)[:, None] & n_ok[None, :], other=0)
    if DEQUANT == "x2":
        BF16: tl.constexpr = s.dtype == tl.bfloat16
        # each half holds 128 + q (1024 + q): that bias goes with the zero
        zv = _pair((-(z.to(tl.float32) + (128.0 if BF16 else 1024.0))).to(s.dtype))
        sv = _pair(s)
    else:
        zv = z
        sv = s
    zv = zv[:, None] if SWAP_AB else zv[None, :]  # broadcast along the tile's K axis
    sv = sv[:, None] if SWAP_AB else sv[None, :]
    if DEQUANT == "x2":
        p = tl.inline_asm_elementwise(
            _X2_ASM_BF16 if BF16 else _X2_ASM_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
            [qw, zv, sv], dtype=(s.dtype,) * 8, is_pure=True, pack=1)
        return p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]
    else:
        zb = zv.to(tl.float32) + 8388608.0
        sf = sv.to(tl.float32)
        return (_nibble_plane(qw, 0, zb, sf), _nibble_plane(qw, 1, zb, sf),
                _nibble_plane(qw, 2, zb, sf), _nibble_plane(qw, 3, zb, sf),
                _nibble_plane(qw, 4, zb, sf), _nibble_plane(qw, 5, zb, sf),
                _nibble_plane(qw, 6, zb, sf), _nibble_plane(qw, 7, zb, sf))


@triton.jit
def _split_planes(x):
    """[R, C, 2, 2, 2] (column 8c + 4a + 2b + d at [r, c, a, b, d]) -> its eight [R, C] planes,
    plane j holding columns 8c + j."""
    d0, d1 = tl.split(x)
    d0b0, d0b1 = tl.split(d0)
    d1b0, d1b1 = tl.split(d1)
    p0, p4 = tl.split(d0b0)
    p2, p6 = tl.split(d0b1)
    p1, p5 = tl.split(d1b0)
    p3, p7 = tl.split(d1b1)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _join_planes(p):
    """Eight [R, C] planes -> [8R, C] with row 8i + j = plane j's row i."""
    # join adds a last axis: [r, c, d, e, f] = p[4f + 2e + d]
    a = tl.join(tl.join(tl.join(p[0], p[1]), tl.join(p[2], p[3])),
                tl.join(tl.join(p[4], p[5]), tl.join(p[6], p[7])))
    R: tl.constexpr = p[0].shape[0]
    C: tl.constexpr = p[0].shape[1]
    return tl.reshape(tl.permute(a, (0, 4, 3, 2, 1)), (8 * R, C))  # row 8r + 4f + 2e + d


@triton.jit(do_not_specialize=["M"])  # rows change every step (see paged_attention.py)
def _w4a16_decode_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, group_size, k_per_split, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, USE_DOT: tl.constexpr,
    BCAST_LOAD: tl.constexpr, DEQUANT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if DEQUANT == "x2planes":  # one [BLOCK_M, BLOCK_K/8] x [BLOCK_K/8, BLOCK_N] per plane
            planes = _load_planes_x2(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
                                     BLOCK_K)
            k = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            xp = _split_planes(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 2, 2)))
            for j in tl.static_range(8):  # tl.dot only (w4a16_decode checks)
                acc += tl.dot(xp[j], planes[j])
        else:
            k = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            if DEQUANT == "x2":
                w = _join_planes(_load_planes_x2(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K,
                                                 group_size, BLOCK_K))
            else:
                w = _load_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
                               BLOCK_K, BLOCK_N, BCAST_LOAD)
            if USE_DOT:
                acc += tl.dot(x, w.to(x.dtype))
            else:
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :],
                              axis=1)
    _finish(acc, part_ptr, lock_ptr, pid_n, pid_k, offs_m, offs_n, m_ok, n_ok, M, N, bias_ptr,
            out_ptr, stride_om, HAS_BIAS, REDUCE, BLOCK_M, BLOCK_N)


@triton.jit
def _finish(acc, part_ptr, lock_ptr, tile, pid_k, offs_m, offs_n, m_ok, n_ok, M, N, bias_ptr,
            out_ptr, stride_om, HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes a program's [BLOCK_M, BLOCK_N] result: directly (REDUCE 0), or as a split-K partial
    in fp32 [split, M, N] that the last program of this output tile sums (2, one launch) or
    _splitk_reduce_kernel does (1)."""
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if REDUCE != 0:
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=mn_ok)
        if REDUCE == 2:
            tl.debug_barrier()  # all of this program's stores before the release below
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            if arrived == tl.num_programs(1) - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(tl.num_programs(1)):
                    acc += tl.load(part_ptr + s * M * N + part_offs, mask=mn_ok, other=0.0,
                                   cache_modifier=".cg")
                _store_out(acc, bias_ptr, out_ptr, offs_m, offs_n, n_ok, mn_ok, stride_om,
                           HAS_BIAS)
                tl.atomic_xchg(lock_ptr + tile, 0)  # leave the lock zeroed for the next call
    else:
        _store_out(acc, bias_ptr, out_ptr, offs_m, offs_n, n_ok, mn_ok, stride_om, HAS_BIAS)


@triton.jit
def _store_out(acc, bias_ptr, out_ptr, offs_m, offs_n, n_ok, mn_ok, stride_om,
               HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mn_ok)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, SPLIT, stride_om,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _prefill_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BCAST_LOAD: tl.constexpr, DEQUANT: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of W: packed pairs joined back in the activation dtype ("x2"), or
    float32."""
    if DEQUANT == "fp32":
        return _dequant_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, BLOCK_N, BCAST_LOAD)
    else:
        return _join_planes(_tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, False,
                                         "x2"))


@triton.jit(do_not_specialize=["M"])
def _w4a16_prefill_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, group_size, k_per_split, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, BCAST_LOAD: tl.constexpr, DEQUANT: tl.constexpr,
    SWAP_AB: tl.constexpr, PLANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)  # split-K part (grid axis 1 is 1 without a split)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # scales and zeros are loaded one tile ahead: the compiler pipelines the weight and x loads
    # into shared memory but not these, whose latency would otherwise stall every tile
    s, z = _load_scale_zero(s_ptr, z_ptr, k_start, offs_n, n_ok, N, group_size)
    if SWAP_AB:  # out^T = W^T x^T: the dequantized weight is wgmma's A operand, from registers
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PLANES:  # this tile's scales and zeros: with planes the compiler pipelines them
            s, z = _load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size)
        else:
            k_next = tl.minimum(k0 + BLOCK_K, k_end - 1)  # the last tile reloads its group
            s_next, z_next = _load_scale_zero(s_ptr, z_ptr, k_next, offs_n, n_ok, N,
                                              group_size)
        k = k0 + offs_k
        if PLANES:  # x is plane-major: tile row 8i + j of W meets x column k0 + 16j + i
            p = _tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, SWAP_AB, DEQUANT)
            for j in tl.static_range(8):
                kj = k0 + 16 * j + tl.arange(0, 16)
                if SWAP_AB:
                    xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + kj[:, None],
                                 mask=m_ok[None, :], other=0.0)  # [16, BLOCK_M]
                    acc += tl.dot(p[j].to(xt.dtype), xt)
                else:
                    xj = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kj[None, :],
                                 mask=m_ok[:, None], other=0.0)  # [BLOCK_M, 16]
                    acc += tl.dot(xj, p[j].to(xj.dtype))
        elif SWAP_AB:
            xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + k[:, None],
                         mask=m_ok[None, :] & (k < K)[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
            w = _prefill_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, BLOCK_N,
                              BCAST_LOAD, DEQUANT)
            acc += tl.dot(tl.trans(w.to(xt.dtype)), xt)
        else:
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            w = _prefill_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, BLOCK_N,
                              BCAST_LOAD, DEQUANT)
            acc += tl.dot(x, w.to(x.dtype))
        if not PLANES:
            s, z = s_next, z_next
    if SWAP_AB:
        acc = tl.trans(acc)
    _finish(acc, part_ptr, lock_ptr, pid, pid_k, offs_m, offs_n, m_ok, n_ok, M, N, bias_ptr,
            out_ptr, stride_om, HAS_BIAS, REDUCE, BLOCK_M, BLOCK_N)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W[k, n] in the output dtype, one [BLOCK_K, BLOCK_N] tile per program."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = _load_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size, BLOCK_K, BLOCK_N,
                   False)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + k[:, None].to(tl.int64) * N + offs_n[None, :],
             w.to(w_ptr.dtype.element_ty), mask=(k < K)[:, None] & n_ok[None, :])


def dequantize_weight(qweight, scales, zeros, group_size, dtype: torch.dtype) -> torch.Tensor:
    """The full weight [K, N] in `dtype`, bit-identical to kernels.w4a16_reference.dequantize
    rounded to dtype."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_k = min(64, group_size)
    _dequant_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, 128))](
        qweight, scales, zeros, w, n, k, group_size, BLOCK_K=block_k, BLOCK_N=128,
        num_warps=4)
    return w


def w4a16_dequant_matmul(x, qweight, scales, zeros, group_size, bias=None, *, out=None):
    """Many rows: dequantize the weight once, then a cuBLAS GEMM; no act-order gather."""
    m, n, _ = _check(x, qweight, scales, zeros, group_size, bias, None)
    out = _out(out, m, n, x)
    if m == 0:
        return out
    w = dequantize_weight(qweight, scales, zeros, group_size, x.dtype)
    if bias is None:
        return torch.matmul(x, w, out=out)
    return torch.addmm(bias, x, w, out=out)


def _check(x, qweight, scales, zeros, group_size, bias, perm):
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_inner_contiguous("x", x)
    m, k = x.shape
    check_tensor("qweight", qweight, 2, (torch.int32,), x.device)
    check_contiguous("qweight", qweight)
    n = qweight.shape[1]
    if k % 8 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight shape {tuple(qweight.shape)} does not pack K={k} (K/8 rows)")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    groups = -(-k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        check_tensor(name, t, 2, FLOAT_DTYPES, x.device)
        check_contiguous(name, t)
        if tuple(t.shape) != (groups, n):
            raise ValueError(f"{name} shape {tuple(t.shape)} != ({groups}, {n})")
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES, x.device)
        if bias.shape[0] != n or bias.stride(0) != 1:
            raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    if perm is not None:
        check_tensor("perm", perm, 1, (torch.int32, torch.int64), x.device)
        if perm.shape[0] != k:
            raise ValueError(f"perm has {perm.shape[0]} entries, K={k}")
    return m, n, k


def _out(out, m, n, x):
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor("out", out, 2, (x.dtype,), x.device)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out shape {tuple(out.shape)} != ({m}, {n})")
    check_inner_contiguous("out", out)
    return out


_LOCKS: dict[torch.device, torch.Tensor] = {}


def _locks(device: torch.device, count: int) -> torch.Tensor:
    """Split-K arrival counters, zero between calls (the last program of a tile resets its own);
    a cache, not state: any zeroed buffer of this size works."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < count:
        locks = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


def _dequant(dequant: str, x: torch.Tensor, block_k: int) -> str:
    """The packed-pair paths run inline PTX: CUDA and 16-bit activations only (the interpreter
    and fp32 take the fp32 path). One dot per plane needs K >= 16 per plane: BLOCK_K 128."""
    if dequant == "fp32" or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return "fp32"
    if dequant == "x2planes" and block_k < 128:
        return "x2"
    return dequant


def w4a16_decode(x, qweight, scales, zeros, group_size, bias=None, *, out=None,
                 config: DecodeConfig = DecodeConfig()) -> torch.Tensor:
    """Split-K kernel for few rows (M <= 16); no act-order gather (w4a16_gemm does that)."""
    m, n, k = _check(x, qweight, scales, zeros, group_size, bias, None)
    if m > DECODE_MAX_ROWS:
        raise ValueError(f"decode kernel takes at most {DECODE_MAX_ROWS} rows, got {m}")
    out = _out(out, m, n, x)
    if m == 0:
        return out
    block_k = min(config.block_k, group_size)
    block_m = 16 if config.use_dot else triton.next_power_of_2(m)
    dequant = _dequant(config.dequant, x, block_k)
    if dequant == "x2planes" and not config.use_dot:
        raise ValueError("dequant='x2planes' multiplies with tl.dot (use_dot=True)")
    num_n = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = config.split_k or max(1, min(k_tiles, config.target_programs // num_n))
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    reduce = 0 if split == 1 else 2 if config.lock_reduce else 1
    locks = _locks(x.device, num_n) if reduce == 2 else part
    dummy = bias if bias is not None else out
    _w4a16_decode_kernel[(num_n, split)](
        x, qweight, scales, zeros, dummy, out, part, locks, m, n, k, group_size,
        tiles_per_split * block_k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, REDUCE=reduce, USE_DOT=config.use_dot,
        BCAST_LOAD=config.bcast_load, DEQUANT=dequant, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if reduce == 1:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            part, dummy, out, m, n, split, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return out


PLANE_BLOCK = 128  # K block of the plane-major order; the kernel's BLOCK_K with `planes`


def plane_major(x: torch.Tensor) -> torch.Tensor:
    """x's columns reordered within each block of 128 so that the rows one nibble plane of a
    128-row weight tile holds (8i + j, i = 0..15) are contiguous: column 8i + j moves to
    16j + i. K is zero-padded to a multiple of 128 (the weight's missing rows then meet zeros).
    One copy of x ([M, K], small next to the weight)."""
    m, k = x.shape
    kp = -(-k // PLANE_BLOCK) * PLANE_BLOCK
    if kp != k:
        x = torch.nn.functional.pad(x, (0, kp - k))
    return x.reshape(m, kp // PLANE_BLOCK, 16, 8).transpose(2, 3).reshape(m, kp)


def w4a16_prefill(x, qweight, scales, zeros, group_size, bias=None, *, out=None,
                  config: PrefillConfig = PrefillConfig()) -> torch.Tensor:
    """Tiled kernel for many rows; no act-order gather (w4a16_gemm does that)."""
    m, n, k = _check(x, qweight, scales, zeros, group_size, bias, None)
    out = _out(out, m, n, x)
    if m == 0:
        return out
    block_k = min(config.block_k, group_size)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, block_k)
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(config.split_k, k_tiles)))
    split = triton.cdiv(k_tiles, tiles_per_split)
    part = out
    if split > 1:
        if split * m * n >= 2**31:
            raise ValueError(f"split-K partials of {split}x{m}x{n} overflow int32 offsets")
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    locks = _locks(x.device, tiles) if split > 1 else part
    planes = config.planes and block_k == PLANE_BLOCK
    xk = plane_major(x) if planes else x
    _w4a16_prefill_kernel[(tiles, split)](
        xk, qweight, scales, zeros, bias if bias is not None else out, out, part, locks,
        m, n, k, group_size, tiles_per_split * block_k, xk.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, REDUCE=2 if split > 1 else 0, BCAST_LOAD=config.bcast_load,
        DEQUANT=_dequant(config.dequant, x, block_k).replace("x2planes", "x2"),
        SWAP_AB=config.swap_ab, PLANES=planes, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _planes_split(tiles: int, k: int, target: int) -> int:
    """Split-K for the plane-major kernel: at least `target` programs, and no program with more
    than 16 K tiles of 128 (the K=14336 shapes wanted 8 splits at 32-64 rows)."""
    split = _split_for(tiles, target, 16)
    while k > 16 * PLANE_BLOCK * split and split < 16:
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, group_size: int = 128) -> DecodeConfig | PrefillConfig:
    """Winners of the sweeps in benchmarks/quant/bench_w4a16.py on an H200 (bf16, G=128,
    Llama-3.1-8B shapes): --packed for the decode rows (results/w4a16_gemm_2026-11-30T024437
    .jsonl), --planes for 17-128 rows (..T042134.jsonl); groups under 128 keep the reshaped-tile
    configs of ..T031054.jsonl. Off CUDA, or with fp32 activations, the packed-pair
    dequantization falls back to fp32 with the same tiles."""
    big = _big(n, k)
    if m <= DECODE_MAX_ROWS:  # packed pairs, one dot per plane: 1.3-1.55x of bf16
        return DecodeConfig(block_n=256 if big else 64, target_programs=264 if big else 528,
                            dequant="x2planes")
    # split-K, weight as the register operand: one program per output tile took ~1.4 us per K
    # tile whatever its rows, so the programs must be many
    # Each output tile's rows are one M tile: more M tiles would dequantize each weight again.
    if group_size >= PLANE_BLOCK:
        # plane-major x: the weight's words reach wgmma's register operand without a trip
        # through shared memory (BLOCK_N = 16 x warps keeps it so, sass_w4a16.py --tiled)
        if m <= 32 and not big:  # 0.98-1.00x of bf16 (reshaped tile: 0.89-0.93x)
            return PrefillConfig(block_m=32, block_n=64, block_k=128, num_warps=4,
                                 num_stages=4, dequant="x2", swap_ab=True, planes=True,
                                 split_k=_planes_split(triton.cdiv(n, 64), k, 256))
        block_m = 32 if m <= 32 else 64 if m <= 64 else 128
        # 32 rows 1.01-1.09x on the big shapes; 64 rows 0.68-1.00x (0.56-0.85x before);
        # 128 rows on the big shapes 0.60-0.62x (0.53-0.65x), where more splits lose
        # (..T042844.jsonl: 4096x14336 took 73 us at split 8, 63 at 4)
        tiles = triton.cdiv(n, 128)
        split = _planes_split(tiles, k, 128) if m <= 64 else _split_for(tiles, 112, 4)
        return PrefillConfig(block_m=block_m, block_n=128, block_k=128, num_warps=8,
                             num_stages=3, dequant="x2", swap_ab=True, planes=True,
                             split_k=split)
    if m <= 32:  # 0.88-1.03x of bf16 at 32 rows (was 0.29-0.67x)
        split = _split_for(triton.cdiv(n, 128), 256, 16)
        return PrefillConfig(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4,
                             dequant="x2", swap_ab=True, split_k=split)
    if m <= DEQUANT_MIN_ROWS:  # 0.76-0.82x at 64 rows on the big shapes (was 0.47-0.69x)
        split = _split_for(triton.cdiv(n, 128), 192, 8)
        return PrefillConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4,
                             dequant="x2", swap_ab=True, split_k=split)
    split = _split_for(triton.cdiv(n, 128), 192, 4)  # 0.52-0.65x at 128 (dequant: 0.44-0.47x)
    return PrefillConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                         dequant="x2", swap_ab=True, split_k=split)


def w4a16_gemm(
    x: torch.Tensor,  # [M, K] activations
    qweight: torch.Tensor,  # [K/8, N] int32
    scales: torch.Tensor,  # [ceil(K/G), N]
    zeros: torch.Tensor,  # [ceil(K/G), N]
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    perm: torch.Tensor | None = None,  # [K] act-order
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    if perm is not None:
        _check(x, qweight, scales, zeros, group_size, bias, perm)
        x = x.index_select(1, perm)
    m, k = x.shape
    if x.is_cuda and m > DECODE_MAX_ROWS:  # on Hopper, the Gluon kernel where it won
        from pagedserve.kernels import w4a16_gluon

        if w4a16_gluon.available(x, group_size):
            gcfg = w4a16_gluon.pick_config(m, qweight.shape[1], k)
            if gcfg is not None:
                return w4a16_gluon.w4a16_gluon(x, qweight, scales, zeros, group_size, bias,
                                               out=out, config=gcfg)
    if use_dequant_matmul(m, qweight.shape[1], k):
        return w4a16_dequant_matmul(x, qweight, scales, zeros, group_size, bias, out=out)
    cfg = pick_config(m, qweight.shape[1], k, group_size)
    if isinstance(cfg, DecodeConfig):
        return w4a16_decode(x, qweight, scales, zeros, group_size, bias, out=out, config=cfg)
    return w4a16_prefill(x, qweight, scales, zeros, group_size, bias, out=out, config=cfg)
