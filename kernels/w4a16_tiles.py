"""Triton device functions of the W4A16 decode and prefill kernels: a weight tile dequantized
(fp32 by the 2^23 trick, or packed bf16x2/f16x2 pairs by inline PTX), the split of x's columns
and the join of the weight's rows by nibble plane, and the split-K epilogue.

A weight tile is rows k0..k0+BLOCK_K of W for BLOCK_N columns, read as [BLOCK_K/8, BLOCK_N]
packed words; BLOCK_K divides the group size, so one tile has one row of scales and zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedserve.kernels.w4a16_common import x2_variants


@triton.jit
def load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size):
    """The scales and zeros of the group holding row k0, in the activation dtype."""
    g = k0 // group_size
    s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
    z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)
    return s, z


@triton.jit
def load_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows k0..k0+BLOCK_K of W, dequantized: [BLOCK_K, BLOCK_N] float32."""
    s, z = load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size)
    return dequant_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, BLOCK_N)


@triton.jit
def dequant_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """load_tile with the tile's scales and zeros given. Each word is loaded once, unpacked to
    [BLOCK_K/8, 8, BLOCK_N] and reshaped."""
    k8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    qw = tl.load(qw_ptr + k8[:, None] * N + offs_n[None, :],
                 mask=(k8 < K // 8)[:, None] & n_ok[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    q = tl.reshape((qw[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
    # no int->float convert (a slow instruction): the nibble OR-ed into the mantissa of 2^23
    # reads 2^23 + q exactly, and subtracting 2^23 + z leaves q - z exactly
    zb = z.to(tl.float32) + 8388608.0
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
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
_X2_ASM_BF16, _X2_ASM_FP16 = x2_variants(_X2_ASM)


@triton.jit
def _pair(v):
    """16-bit floats (any shape) -> int32 words holding each twice (an operand of _X2_ASM)."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _nibble_plane(qw, j: tl.constexpr, zb, sf):
    """fp32 plane j of packed words (the 2^23 trick of dequant_tile)."""
    qf = (((qw >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    return (qf - zb) * sf


@triton.jit
def tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K: tl.constexpr,
                TRANSPOSED: tl.constexpr, DEQUANT: tl.constexpr):
    """Rows k0..k0+BLOCK_K of W as eight planes, plane j holding rows k0 + 8i + j: [BLOCK_K/8,
    BLOCK_N], or [BLOCK_N, BLOCK_K/8] when TRANSPOSED; packed pairs in the activation dtype
    (DEQUANT "x2") or float32 ("fp32"). A plane is already in the layout the tensor cores read,
    which a [BLOCK_K, BLOCK_N] tile only reaches through a shuffle in shared memory."""
    k8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if TRANSPOSED:
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
    zv = zv[:, None] if TRANSPOSED else zv[None, :]  # broadcast along the tile's K axis
    sv = sv[:, None] if TRANSPOSED else sv[None, :]
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
def split_planes(x):
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
def join_planes(p):
    """Eight [R, C] planes -> [8R, C] with row 8i + j = plane j's row i."""
    # join adds a last axis: [r, c, d, e, f] = p[4f + 2e + d]
    a = tl.join(tl.join(tl.join(p[0], p[1]), tl.join(p[2], p[3])),
                tl.join(tl.join(p[4], p[5]), tl.join(p[6], p[7])))
    R: tl.constexpr = p[0].shape[0]
    C: tl.constexpr = p[0].shape[1]
    return tl.reshape(tl.permute(a, (0, 4, 3, 2, 1)), (8 * R, C))  # row 8r + 4f + 2e + d


@triton.jit
def finish(acc, part_ptr, lock_ptr, tile, pid_k, offs_m, offs_n, m_ok, n_ok, M, N, bias_ptr,
           out_ptr, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes a program's [BLOCK_M, BLOCK_N] result: directly, or with SPLIT_K as a partial in
    fp32 [split, M, N] that the last program to arrive at this output tile sums (one launch,
    no reduce kernel)."""
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K:
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=mn_ok)
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
