"""A few rows times a weight: out [M, N] = x [M, K] @ w [N, K]^T (+ bias), one Triton launch
for the dense projections of a decode step of one to a few sequences.

At one token cuBLAS reads Qwen3-30B-A3B's q/k/v weight at ~2.2 TB/s on an H100 and splits
o_proj's K with a second reduce launch (docs/performance.md); here a program per (row, block
of N) walks all of K in one unrolled pass (K is a compile-time width, one variant per
projection), so each program's loads are in flight together and no reduce follows. Rows
past one re-read the weight tile (from L2), so it serves a few rows only: the executor's
Linear (executor_svc/layers.py) takes it on CUDA for at most PAGEDSERVE_DENSE_GEMV_ROWS rows
(1 by default since de6b1b5, weights of at most 24 MiB: timed on an H100, gpu.sh gemv; its
tiles: bench_gemv.py --sweep). The torch path is F.linear itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import FLOAT_DTYPES, check_tensor


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, stride_xm, stride_wn, stride_om,
                 N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: the tiles' loads issue together
        k_ok = offs_k < K - k0
        a = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=k_ok, other=0.0)
        b = tl.load(rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * a.to(tl.float32)[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): 4,096 weights a program step (32 a thread at 4 warps), at most
    1,024 columns wide: moe_decode's GEMVs' (fused_moe.decode_tiles)."""
    block_k = min(1024, triton.next_power_of_2(k))
    return max(1, min(4096 // block_k, triton.next_power_of_2(n))), block_k


def dense_tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of gemv() by default: one output a program, up to 2,048 columns a
    step. Swept at one row on an H100 (bench_gemv.py --sweep, 328ad22, Qwen3-30B-A3B's
    shapes), (1, 2048) at 4 warps was within 2 % of each shape's fastest of 38-44 configs
    (q/k/v 8.69 us, o_proj 7.36, router 1.88) where tiles()'s (4, 1024) took 8.83, 9.81 and
    2.72: o_proj's K of 4,096 in two steps, not four, and twice the programs. In the service
    (Qwen3-30B-A3B single stream, H100, a8e9eeb, PAGEDSERVE_DENSE_GEMV_BLOCK alternated):
    256 out tok/s against 242 and 244 with (4, 1024), +5.4 % (~4 % predicted), 0.52 of the
    bound."""
    return 1, min(2048, triton.next_power_of_2(k))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block: tuple[int, int] | None = None, num_warps: int = 4) -> torch.Tensor:
    """F.linear(x, weight, bias) for a few rows of x [M, K] (weight [N, K], x's dtype); float32
    sums of exact products, rounded once. block (BLOCK_N, BLOCK_K) and num_warps:
    dense_tiles()'s and 4 unless given (bench_gemv.py --sweep times others)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, (x.dtype,), x.device)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, {k}] (x's last dim)")
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,), x.device)
        if bias.shape[0] != n:
            raise ValueError(f"bias {tuple(bias.shape)} must be [{n}]")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must have unit stride in their last dim")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k = block or dense_tiles(n, k)
    _gemv_kernel[(m, triton.cdiv(n, block_n))](
        x, weight, bias if bias is not None else x, out, x.stride(0), weight.stride(0),
        out.stride(0), N=n, K=k, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps)
    return out
