"""W4A16 GEMM: out[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias), 4-bit weights dequantized on
the fly, 16/32-bit activations, fp32 accumulation. w4a16_gemm picks a kernel by rows.

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
A last partial group (K % G != 0, e.g. K=576 at G=128) is allowed. Every kernel's dequantized
weight is bit-identical to w4a16_reference.dequantize rounded to the activation dtype.

Bands (docs/kernels.md says why each wins where it does):
- M <= 16: w4a16_decode (split-K over the weight read);
- 17-256 rows on Hopper, where it won: w4a16_gluon;
- up to 128 rows (64 on the attention shapes): w4a16_prefill (split-K, swap-AB tiles);
- beyond: the weight dequantized once into a scratch, then cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.w4a16_common import (
    PLANE_BLOCK,
    check_gemm_args,
    gemm_out,
    large_weight,
    planes_split,
    split_for,
)
from pagedserve.kernels.w4a16_decode import DECODE_MAX_ROWS, DecodeConfig, w4a16_decode
from pagedserve.kernels.w4a16_gluon import GluonConfig, w4a16_gluon
from pagedserve.kernels.w4a16_gluon import available as gluon_available
from pagedserve.kernels.w4a16_prefill import PrefillConfig, w4a16_prefill
from pagedserve.kernels.w4a16_tiles import load_tile

DEQUANT_MIN_ROWS = 64  # rows beyond which dequantize-then-cuBLAS wins (see use_dequant_matmul)


def use_dequant_matmul(m: int, n: int, k: int) -> bool:
    """Beyond 128 rows (64 on the attention shapes) one pass that dequantizes the weight, then
    a bf16 GEMM at cuBLAS's rate, beats every tiled kernel."""
    return m > 2 * DEQUANT_MIN_ROWS or (m > DEQUANT_MIN_ROWS and not large_weight(n, k))


def pick_config(m: int, n: int, k: int, group_size: int = 128) -> DecodeConfig | PrefillConfig:
    """The Triton kernel and its tiles for M rows (bf16/fp16 on CUDA; elsewhere the same tiles
    dequantize in fp32). Split-K throughout: one program per output tile takes the same time
    per K tile whatever its rows, so the programs must be many. Each output tile's rows are
    one M tile: more M tiles would dequantize each weight tile again."""
    big = large_weight(n, k)
    if m <= DECODE_MAX_ROWS:
        return DecodeConfig(block_n=256 if big else 64, target_programs=264 if big else 528)
    if group_size >= PLANE_BLOCK:  # plane-major x; BLOCK_N = 16 x warps
        if m <= 32 and not big:
            return PrefillConfig(block_m=32, block_n=64, block_k=128, num_warps=4,
                                 num_stages=4, planes=True,
                                 split_k=planes_split(triton.cdiv(n, 64), k, 256))
        block_m = 32 if m <= 32 else 64 if m <= 64 else 128
        tiles = triton.cdiv(n, 128)
        # at 128 rows more splits lose: each program's tile is already large
        split = planes_split(tiles, k, 128) if m <= 64 else split_for(tiles, 112, 4)
        return PrefillConfig(block_m=block_m, block_n=128, block_k=128, num_warps=8,
                             num_stages=3, planes=True, split_k=split)
    if m <= 32:
        split = split_for(triton.cdiv(n, 128), 256, 16)
        return PrefillConfig(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4,
                             split_k=split)
    if m <= DEQUANT_MIN_ROWS:
        split = split_for(triton.cdiv(n, 128), 192, 8)
        return PrefillConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4,
                             split_k=split)
    split = split_for(triton.cdiv(n, 128), 192, 4)
    return PrefillConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                         split_k=split)


def pick_gluon_config(m: int, n: int, k: int) -> GluonConfig | None:
    """The Gluon kernel's tiles for M rows, or None where another path is as fast or faster:
    up to 16 rows (decode), up to 32 on the attention shapes (the plane-major Triton kernel
    ties), beyond 128 rows there and beyond 256 on all (dequantize + cuBLAS)."""
    big = large_weight(n, k)
    tiles = triton.cdiv(n, 128)
    if m <= DECODE_MAX_ROWS or (m <= 32 and not big):
        return None
    if m <= 32:
        return GluonConfig(32, 8, 3, planes_split(tiles, k, 128))
    if m <= 64:
        if big:
            return GluonConfig(64, 8, 3, planes_split(tiles, k, 128))
        return GluonConfig(64, 4, 4, planes_split(triton.cdiv(n, 64), k, 256))
    if m <= 128:
        return GluonConfig(128, 8, 3, split_for(tiles, 96, 4))
    if m <= 256 and big:
        return GluonConfig(256, 8, 2, split_for(tiles, 96, 4))
    return None


def choose(x: torch.Tensor, n: int, group_size: int
           ) -> DecodeConfig | PrefillConfig | GluonConfig | None:
    """What w4a16_gemm runs for x [M, K] and an [K, N] weight: a kernel's config, or None for
    dequantize-then-cuBLAS."""
    m, k = x.shape
    if m > DECODE_MAX_ROWS and gluon_available(x, group_size):
        cfg = pick_gluon_config(m, n, k)
        if cfg is not None:
            return cfg
    if use_dequant_matmul(m, n, k):
        return None
    return pick_config(m, n, k, group_size)


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
        check_gemm_args(x, qweight, scales, zeros, group_size, bias, perm)
        x = x.index_select(1, perm)
    args = (x, qweight, scales, zeros, group_size, bias)
    cfg = choose(x, qweight.shape[1], group_size)
    if cfg is None:
        return w4a16_dequant_matmul(*args, out=out)
    if isinstance(cfg, GluonConfig):
        return w4a16_gluon(*args, out=out, config=cfg)
    if isinstance(cfg, DecodeConfig):
        return w4a16_decode(*args, out=out, config=cfg)
    return w4a16_prefill(*args, out=out, config=cfg)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W[k, n] in the output dtype, one [BLOCK_K, BLOCK_N] tile per program."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = load_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size, BLOCK_K, BLOCK_N)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + k[:, None].to(tl.int64) * N + offs_n[None, :],
             w.to(w_ptr.dtype.element_ty), mask=(k < K)[:, None] & n_ok[None, :])


def dequantize_weight(qweight, scales, zeros, group_size, dtype: torch.dtype) -> torch.Tensor:
    """The full weight [K, N] in `dtype`, bit-identical to w4a16_reference.dequantize rounded
    to dtype."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_k = min(64, group_size)
    _dequant_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, 128))](
        qweight, scales, zeros, w, n, k, group_size, BLOCK_K=block_k, BLOCK_N=128,
        num_warps=4)
    return w


def w4a16_dequant_matmul(x, qweight, scales, zeros, group_size, bias=None, *, out=None):
    """Many rows: dequantize the weight once, then a cuBLAS GEMM; no act-order gather. The
    scratch costs one memory-bound pass (~4.5 bytes moved per weight)."""
    m, n, _ = check_gemm_args(x, qweight, scales, zeros, group_size, bias, None)
    out = gemm_out(out, m, n, x)
    if m == 0:
        return out
    w = dequantize_weight(qweight, scales, zeros, group_size, x.dtype)
    if bias is None:
        return torch.matmul(x, w, out=out)
    return torch.addmm(bias, x, w, out=out)
