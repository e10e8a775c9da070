"""W4A16 tiled kernel for 17-128 rows (the Triton path; on Hopper the Gluon kernel takes most of
this band). Each program computes one [BLOCK_M, BLOCK_N] output tile over K/split rows:

- swap-AB, out^T = W^T x^T: the dequantized weight is the tensor cores' register operand and x
  the shared-memory one, so the weight never goes through shared memory and a tile's rows can
  be as few as 32 (wgmma's N);
- split-K with the decode kernel's epilogue (the last program of each output tile sums the fp32
  partials): the programs' count, not their work, bounded this kernel;
- PLANES (group size >= 128): x arrives in plane-major order (w4a16_common.plane_major), so
  each nibble plane of a 128-row tile multiplies 16 contiguous columns of x in its own dot and
  the packed words reach the operand layout without a reshape. A group under 128 rows joins the
  planes into one [BLOCK_K, BLOCK_N] tile first.

Why these shapes: docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.w4a16_common import (
    PLANE_BLOCK,
    check_gemm_args,
    gemm_out,
    packed_pairs,
    plane_major,
    split_k_locks,
    split_k_partials,
)
from pagedserve.kernels.w4a16_tiles import (
    dequant_tile,
    finish,
    join_planes,
    load_scale_zero,
    tile_planes,
)


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64  # at most the group size
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # K parts per output tile
    # one dot per nibble plane against plane-major x; needs BLOCK_K 128 (a group size >= 128),
    # else ignored. BLOCK_N = 16 x warps keeps every warp's slab of W^T in registers.
    planes: bool = False


@triton.jit
def _prefill_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, DEQUANT: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of W: packed pairs joined back in the activation dtype ("x2"), or
    float32."""
    if DEQUANT == "fp32":
        return dequant_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, BLOCK_N)
    else:
        return join_planes(tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, False,
                                       "x2"))


@triton.jit(do_not_specialize=["M"])
def w4a16_prefill_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, group_size, k_per_split, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DEQUANT: tl.constexpr,
    PLANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    GROUP_M: tl.constexpr = 8  # M tiles sharing a weight tile run side by side (L2)
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
    s, z = load_scale_zero(s_ptr, z_ptr, k_start, offs_n, n_ok, N, group_size)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    for k0 in range(k_start, k_end, BLOCK_K):
        if PLANES:  # this tile's scales and zeros: with planes the compiler pipelines them
            s, z = load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size)
        else:
            k_next = tl.minimum(k0 + BLOCK_K, k_end - 1)  # the last tile reloads its group
            s_next, z_next = load_scale_zero(s_ptr, z_ptr, k_next, offs_n, n_ok, N,
                                             group_size)
        k = k0 + offs_k
        if PLANES:  # x is plane-major: tile row 8i + j of W meets x column k0 + 16j + i
            p = tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, True, DEQUANT)
            for j in tl.static_range(8):
                kj = k0 + 16 * j + tl.arange(0, 16)
                xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + kj[:, None],
                             mask=m_ok[None, :], other=0.0)  # [16, BLOCK_M]
                acc += tl.dot(p[j].to(xt.dtype), xt)
        else:
            xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + k[:, None],
                         mask=m_ok[None, :] & (k < K)[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
            w = _prefill_tile(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, BLOCK_N, DEQUANT)
            acc += tl.dot(tl.trans(w.to(xt.dtype)), xt)
            s, z = s_next, z_next
    finish(tl.trans(acc), part_ptr, lock_ptr, pid, pid_k, offs_m, offs_n, m_ok, n_ok, M, N,
           bias_ptr, out_ptr, stride_om, HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N)


def w4a16_prefill(x, qweight, scales, zeros, group_size, bias=None, *, out=None,
                  config: PrefillConfig = PrefillConfig()) -> torch.Tensor:
    """out = x @ dequant(W) (+ bias), any rows; no act-order gather (w4a16_gemm does that)."""
    m, n, k = check_gemm_args(x, qweight, scales, zeros, group_size, bias, None)
    out = gemm_out(out, m, n, x)
    if m == 0:
        return out
    block_k = min(config.block_k, group_size)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, block_k)
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(config.split_k, k_tiles)))
    split = triton.cdiv(k_tiles, tiles_per_split)
    part = out if split == 1 else split_k_partials(split, m, n, x.device)
    locks = split_k_locks(x.device, tiles) if split > 1 else part
    planes = config.planes and block_k == PLANE_BLOCK
    xk = plane_major(x) if planes else x
    w4a16_prefill_kernel[(tiles, split)](
        xk, qweight, scales, zeros, bias if bias is not None else out, out, part, locks,
        m, n, k, group_size, tiles_per_split * block_k, xk.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split > 1,
        DEQUANT="x2" if packed_pairs(x) else "fp32", PLANES=planes, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
