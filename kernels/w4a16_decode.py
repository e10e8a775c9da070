"""W4A16 split-K kernel for decode rows (M <= 16): reading the 4-bit weight is all the work, so
the grid is sized to fill the GPU rather than by output tiles. Each program owns BLOCK_N
columns and K/split rows; partials go to fp32 [split, M, N], summed by the last program of each
column tile. The rows are one 16-row tl.dot operand (the tensor cores' minimum M).

With bf16/fp16 on CUDA and BLOCK_K 128, each of the tile's eight nibble planes is dequantized
into packed pairs and multiplied by the matching stride-8 columns of x in its own dot
(DEQUANT "x2planes"): the weight reaches the tensor cores without a trip through shared memory.
A group under 128 rows joins the planes back into one tile ("x2"); fp32 activations and the
interpreter dequantize in fp32 ("fp32"). docs/kernels.md has the measurements behind this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.w4a16_common import (
    check_gemm_args,
    gemm_out,
    packed_pairs,
    split_k_locks,
    split_k_partials,
)
from pagedserve.kernels.w4a16_tiles import (
    finish,
    join_planes,
    load_scale_zero,
    load_tile,
    split_planes,
    tile_planes,
)

DECODE_MAX_ROWS = 16
BLOCK_K = 128  # at most: a tile never straddles two groups, so min(128, group size)
NUM_WARPS = 4
NUM_STAGES = 3


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_n: int = 64
    target_programs: int = 528  # split K until about this many programs run (4 per H200 SM)


def decode_dequant(x: torch.Tensor, block_k: int) -> str:
    """The kernel's DEQUANT for x: per-plane dots need 16 rows per plane (BLOCK_K 128)."""
    if not packed_pairs(x):
        return "fp32"
    return "x2planes" if block_k == 128 else "x2"


@triton.jit
def _load_planes(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
                 BLOCK_K: tl.constexpr):
    """Rows k0..k0+BLOCK_K of W as eight [BLOCK_K/8, BLOCK_N] planes of packed pairs: plane j
    holds rows k0 + 8i + j."""
    s, z = load_scale_zero(s_ptr, z_ptr, k0, offs_n, n_ok, N, group_size)
    return tile_planes(qw_ptr, s, z, k0, offs_n, n_ok, N, K, BLOCK_K, False, "x2")


@triton.jit(do_not_specialize=["M"])  # rows change every step (see paged_attention.py)
def w4a16_decode_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, group_size, k_per_split, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DEQUANT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
            planes = _load_planes(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
                                  BLOCK_K)
            k = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            xp = split_planes(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 2, 2)))
            for j in tl.static_range(8):
                acc += tl.dot(xp[j], planes[j])
        else:
            k = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            if DEQUANT == "x2":
                w = join_planes(_load_planes(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K,
                                             group_size, BLOCK_K))
            else:
                w = load_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_ok, N, K, group_size,
                              BLOCK_K, BLOCK_N)
            acc += tl.dot(x, w.to(x.dtype))
    finish(acc, part_ptr, lock_ptr, pid_n, pid_k, offs_m, offs_n, m_ok, n_ok, M, N, bias_ptr,
           out_ptr, stride_om, HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N)


def w4a16_decode(x, qweight, scales, zeros, group_size, bias=None, *, out=None,
                 config: DecodeConfig = DecodeConfig()) -> torch.Tensor:
    """out = x @ dequant(W) (+ bias) for M <= 16 rows; no act-order gather (w4a16_gemm does
    that)."""
    m, n, k = check_gemm_args(x, qweight, scales, zeros, group_size, bias, None)
    if m > DECODE_MAX_ROWS:
        raise ValueError(f"decode kernel takes at most {DECODE_MAX_ROWS} rows, got {m}")
    out = gemm_out(out, m, n, x)
    if m == 0:
        return out
    block_k = min(BLOCK_K, group_size)
    num_n = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = max(1, min(k_tiles, config.target_programs // num_n))
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)
    part = out if split == 1 else split_k_partials(split, m, n, x.device)
    locks = split_k_locks(x.device, num_n) if split > 1 else part
    w4a16_decode_kernel[(num_n, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, part, locks,
        m, n, k, group_size, tiles_per_split * block_k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split > 1, DEQUANT=decode_dequant(x, block_k),
        BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
