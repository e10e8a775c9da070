"""W4A16 GEMM for 17-256 rows on Hopper, written in Gluon (Triton's explicit-layout dialect).

Why not Triton (kernels/w4a16_prefill.py): there the dequantized weight, wgmma's register
operand, is computed inside the K loop, and Triton's pipeliner then makes every wgmma wait for
the one before, so dequantization and MMA never overlap. Gluon states the layouts and the
waits, so this kernel:

- loads the packed words straight into wgmma's register-operand layout (no shared memory),
  two tiles ahead, and dequantizes two k-adjacent words at a time into packed plane pairs;
- keeps x (plane-major, w4a16_common.plane_major) in shared memory through TMA, in a ring of
  NUM_STAGES buffers with one mbarrier each;
- issues a tile's eight per-plane wgmmas asynchronously and dequantizes the next tile before
  waiting for them, into the other of two register sets (the loop is unrolled by two). ptxas
  still places that dequantization after the wait (it reuses the in-flight wgmmas' operand
  registers); what overlaps is the loads running ahead. docs/kernels.md has the details.

Same packed layout and exactness as the Triton kernels (bit-identical dequantized weights);
bf16/fp16 activations, a group size that is a multiple of 128, CUDA sm_90 only. Split-K parts
go to an fp32 [split, M, N] buffer summed by a second kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels._gluon import (
    TensorDescriptor,
    gl,
    gluon,
    mbarrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from pagedserve.kernels.w4a16_common import (
    PLANE_BLOCK,
    check_gemm_args,
    gemm_out,
    plane_major,
    split_k_partials,
    x2_variants,
)

PLANE = PLANE_BLOCK  # K per tile: 16 words of 8 nibbles


@dataclass(frozen=True, slots=True)
class GluonConfig:
    block_m: int = 128  # rows of x per program (wgmma's N, 8..256)
    num_warps: int = 8  # BLOCK_N = 16 x warps columns of W per program (wgmma's M)
    num_stages: int = 3  # x tiles in flight
    split_k: int = 1


def available(x: torch.Tensor, group_size: int) -> bool:
    """Whether this kernel can run x: Gluon, an sm_90 (Hopper) GPU, 16-bit activations and
    whole 128-row tiles per group."""
    return (gluon is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and group_size % PLANE == 0 and torch.cuda.get_device_capability(x.device)[0] == 9)


# Two words of one row (k-adjacent, as wgmma's register operand holds them) become the eight
# packed 32-bit registers of the eight planes: {nibble j of word 0, nibble j of word 1}. prmt
# puts the words' low (high) halves side by side, then, as in w4a16_tiles.py's _X2_ASM, one
# lop3 per plane makes 128 + q (1024 + q) in each half and two packed fmas give (q - z) * s,
# bit-identical. Built packed, the planes need no repacking before each wgmma (which made
# ptxas wait for every wgmma before the next).
_PAIR_ASM = """{
.reg .b32 lo, hi, t0, t1, t2, t3, t4, t5, t6, t7, one, nz;
mov.b32 one, ONE;
mov.b32 nz, NEGZERO;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 t0, lo, 0x000f000f, MAGIC, 0xea;
shr.u32 lo, lo, 4;
lop3.b32 t1, lo, 0x000f000f, MAGIC, 0xea;
shr.u32 lo, lo, 4;
lop3.b32 t2, lo, 0x000f000f, MAGIC, 0xea;
shr.u32 lo, lo, 4;
lop3.b32 t3, lo, 0x000f000f, MAGIC, 0xea;
lop3.b32 t4, hi, 0x000f000f, MAGIC, 0xea;
shr.u32 hi, hi, 4;
lop3.b32 t5, hi, 0x000f000f, MAGIC, 0xea;
shr.u32 hi, hi, 4;
lop3.b32 t6, hi, 0x000f000f, MAGIC, 0xea;
shr.u32 hi, hi, 4;
lop3.b32 t7, hi, 0x000f000f, MAGIC, 0xea;
fma.rn.TY $0, t0, one, $10;
fma.rn.TY $1, t1, one, $10;
fma.rn.TY $2, t2, one, $10;
fma.rn.TY $3, t3, one, $10;
fma.rn.TY $4, t4, one, $10;
fma.rn.TY $5, t5, one, $10;
fma.rn.TY $6, t6, one, $10;
fma.rn.TY $7, t7, one, $10;
fma.rn.TY $0, $0, $12, nz;
fma.rn.TY $1, $1, $12, nz;
fma.rn.TY $2, $2, $12, nz;
fma.rn.TY $3, $3, $12, nz;
fma.rn.TY $4, $4, $12, nz;
fma.rn.TY $5, $5, $12, nz;
fma.rn.TY $6, $6, $12, nz;
fma.rn.TY $7, $7, $12, nz;
}"""
_PAIR_ASM_BF16, _PAIR_ASM_FP16 = x2_variants(_PAIR_ASM)
_PAIR_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r")


if gluon is not None:

    @gluon.jit
    def _pair(v):
        b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return b | (b << 16)

    @gluon.jit
    def _planes(qw, s, z, DTYPE: gl.constexpr):
        """Eight [BLOCK_N, 16] planes of a tile's words, in qw's layout (plane j: rows 8i + j)."""
        s2 = gl.expand_dims(s, 1)
        z2 = gl.expand_dims(z, 1)
        # pack=2: each asm takes a thread's two k-adjacent words of a row (the register
        # operand's k_width), so negz and s arrive twice ($10/$11, $12/$13; equal)
        BF16: gl.constexpr = gl.bfloat16 == DTYPE
        negz = _pair((-(z2.to(gl.float32) + (128.0 if BF16 else 1024.0))).to(DTYPE))
        p = gl.inline_asm_elementwise(
            _PAIR_ASM_BF16 if BF16 else _PAIR_ASM_FP16, _PAIR_CONSTRAINTS,
            [qw, negz, _pair(s2)], dtype=(s.dtype,) * 8, is_pure=True, pack=2)
        return p

    @gluon.jit
    def _load_words(qw_ptr, s_ptr, z_ptr, t, n_tiles, k_start, offs_n, offs_w, n_ok, N, K,
                    group_size):
        """Tile t's packed words [BLOCK_N, 16] and its scales/zeros; zeros past the last tile."""
        k0 = k_start + t * 128
        live = t < n_tiles
        k8 = k0 // 8 + offs_w
        ok = gl.expand_dims(n_ok, 1) & gl.expand_dims((k8 < K // 8) & live, 0)
        qw = gl.load(qw_ptr + gl.expand_dims(k8, 0) * N + gl.expand_dims(offs_n, 1), mask=ok,
                     other=0)
        g = gl.minimum(k0, K - 1) // group_size
        s = gl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        z = gl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        return qw, s, z

    @gluon.jit
    def _tile(t, p, qw, s, z, acc, xs, bars, x_desc, qw_ptr, s_ptr, z_ptr, n_tiles, n_even,
              k_start, off_m, offs_n, offs_w, n_ok, N, K, group_size,
              NUM_STAGES: gl.constexpr, DTYPE: gl.constexpr):
        """One K tile: its eight wgmmas on planes p issued, the next tile's planes dequantized
        and the tile after's words loaded (before the wait in program order), then the wait
        and x's buffer refilled."""
        buf = t % NUM_STAGES
        mbarrier.wait(bars.index(buf), phase=(t // NUM_STAGES) & 1)
        xt = xs.index(buf).permute((1, 0))  # [128, BLOCK_M], plane j at rows 16j..16j+15
        for j in gl.static_range(8):
            acc = warpgroup_mma(p[j], xt.slice(16 * j, 16), acc, is_async=True)
        p_next = _planes(qw, s, z, DTYPE)
        qw, s, z = _load_words(qw_ptr, s_ptr, z_ptr, t + 2, n_tiles, k_start, offs_n, offs_w,
                               n_ok, N, K, group_size)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        nxt = t + NUM_STAGES
        mbarrier.expect(bars.index(buf), x_desc.block_type.nbytes, pred=nxt < n_even)
        tma_load(x_desc, [off_m, k_start + nxt * 128], bars.index(buf), xs.index(buf),
                 pred=nxt < n_even)
        return acc, p_next, qw, s, z

    @gluon.jit(do_not_specialize=["M"])
    def w4a16_gluon_kernel(x_desc, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr,
                           M, N, K, group_size, k_per_split, stride_om,
                           HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
                           BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                           num_warps: gl.constexpr):
        BLOCK_N: gl.constexpr = 16 * num_warps
        DTYPE: gl.constexpr = x_desc.dtype
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)

        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        num_m = gl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m  # programs sharing a weight tile run side by side (L2)
        pid_n = pid // num_m
        off_m = pid_m * BLOCK_M
        k_start = pid_k * k_per_split
        n_tiles = gl.cdiv(gl.minimum(k_per_split, K - k_start), 128)
        # the loop takes tiles in pairs (see below); an odd last tile gets a dead partner whose
        # words are zeros and whose x, past K, TMA fills with zeros
        n_even = n_tiles + (n_tiles % 2)

        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
        offs_w = gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))
        n_ok = offs_n < N

        xs = gl.allocate_shared_memory(DTYPE, [NUM_STAGES, BLOCK_M, 128], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):  # the first x tiles
            mbarrier.expect(bars.index(i), x_desc.block_type.nbytes, pred=i < n_even)
            tma_load(x_desc, [off_m, k_start + i * 128], bars.index(i), xs.index(i),
                     pred=i < n_even)

        qw, s, z = _load_words(qw_ptr, s_ptr, z_ptr, 0, n_tiles, k_start, offs_n, offs_w, n_ok,
                               N, K, group_size)
        pa = _planes(qw, s, z, DTYPE)
        qw, s, z = _load_words(qw_ptr, s_ptr, z_ptr, 1, n_tiles, k_start, offs_n, offs_w, n_ok,
                               N, K, group_size)
        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma)
        # Unrolled by two, the planes ping-pong between two register sets: a loop-carried set
        # shares its registers across iterations, so dequantizing into it would have to wait
        # for the wgmmas still reading it (ptxas put the dequantization after the wait).
        for t in range(0, n_even, 2):
            acc, pb, qw, s, z = _tile(t, pa, qw, s, z, acc, xs, bars, x_desc, qw_ptr, s_ptr,
                                      z_ptr, n_tiles, n_even, k_start, off_m, offs_n, offs_w,
                                      n_ok, N, K, group_size, NUM_STAGES, DTYPE)
            acc, pa, qw, s, z = _tile(t + 1, pb, qw, s, z, acc, xs, bars, x_desc, qw_ptr, s_ptr,
                                      z_ptr, n_tiles, n_even, k_start, off_m, offs_n, offs_w,
                                      n_ok, N, K, group_size, NUM_STAGES, DTYPE)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(i))

        offs_on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        offs_om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        ok = gl.expand_dims(offs_on < N, 1) & gl.expand_dims(offs_om < M, 0)
        if PARTIAL:  # fp32 [split, M, N], summed (with the bias) by the reduce kernel
            offs = gl.expand_dims(offs_om, 0) * N + gl.expand_dims(offs_on, 1)
            gl.store(part_ptr + pid_k * M * N + offs, acc, mask=ok)
        else:
            if HAS_BIAS:
                b = gl.load(bias_ptr + offs_on, mask=offs_on < N, other=0.0)
                acc = acc + gl.expand_dims(b.to(gl.float32), 1)
            offs = gl.expand_dims(offs_om.to(gl.int64), 0) * stride_om + gl.expand_dims(offs_on, 1)
            gl.store(out_ptr + offs, acc.to(DTYPE), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, SPLIT, stride_om,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m] = sum of the SPLIT fp32 partial rows [s, m] (+ bias), in out's dtype."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def w4a16_gluon(x, qweight, scales, zeros, group_size, bias=None, *, out=None,
                config: GluonConfig = GluonConfig()) -> torch.Tensor:
    """out = x @ dequant(W) (+ bias) for x [M, K] bf16/fp16 on an sm_90 GPU (see available())."""
    m, n, k = check_gemm_args(x, qweight, scales, zeros, group_size, bias, None)
    if not available(x, group_size):
        raise ValueError("the Gluon W4A16 kernel needs Gluon, an sm_90 GPU, bf16/fp16 x and a "
                         f"group size that is a multiple of {PLANE} (got {group_size})")
    out = gemm_out(out, m, n, x)
    if m == 0:
        return out
    xp = plane_major(x)
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([config.block_m, PLANE], gdt)
    x_desc = TensorDescriptor(xp, list(xp.shape), list(xp.stride()), [config.block_m, PLANE],
                              layout)
    k_tiles = triton.cdiv(k, PLANE)
    per_split = triton.cdiv(k_tiles, max(1, min(config.split_k, k_tiles)))
    per_split += per_split % 2  # whole pairs of tiles (the kernel's loop), but in the last part
    split = triton.cdiv(k_tiles, per_split)
    block_n = 16 * config.num_warps
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, block_n)
    part = out if split == 1 else split_k_partials(split, m, n, x.device)
    dummy = bias if bias is not None else out
    w4a16_gluon_kernel[(tiles, split)](
        x_desc, qweight, scales, zeros, dummy, out, part, m, n, k, group_size,
        per_split * PLANE, out.stride(0), HAS_BIAS=bias is not None, PARTIAL=split > 1,
        BLOCK_M=config.block_m, NUM_STAGES=config.num_stages, num_warps=config.num_warps)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            part, dummy, out, m, n, split, out.stride(0), HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4)
    return out
