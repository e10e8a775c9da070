"""W4A16 in torch: unpack the internal 4-bit layout, dequantize, matmul (the CPU path and the
test oracle of kernels/w4a16.py). The layout is documented in kernels/w4a16.py."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of a word holds row 8*i + j


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[K, N] integers in 0..15 -> [K/8, N] int32, 8 consecutive rows per word."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"rows {k} not a multiple of 8")
    q = q.to(torch.int32).view(k // 8, 8, n)
    packed = torch.zeros((k // 8, n), dtype=torch.int32, device=q.device)
    for j in range(8):
        packed |= q[:, j] << (4 * j)
    return packed


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[K/8, N] int32 -> [K, N] int32 in 0..15."""
    kp, n = packed.shape
    shifts = _SHIFTS.to(packed.device)
    return ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(kp * 8, n)


def dequantize(
    qweight: torch.Tensor,  # [K/8, N] int32
    scales: torch.Tensor,  # [ceil(K/G), N]
    zeros: torch.Tensor,  # [ceil(K/G), N], integer-valued
    group_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [K, N]: ((q - z) * s) in float32, rounded once to dtype
    q = unpack_int4(qweight).float()
    k, n = q.shape
    full = k // group_size * group_size  # groups broadcast over their rows, no repeated copies
    w = torch.empty((k, n), dtype=torch.float32, device=q.device)
    g = full // group_size
    w[:full].view(g, group_size, n).copy_(
        (q[:full].view(g, group_size, n) - zeros[:g, None].float()) * scales[:g, None].float())
    if full < k:  # a last partial group
        w[full:] = (q[full:] - zeros[g:].float()) * scales[g:].float()
    return w.to(dtype or scales.dtype)


def w4a16_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    perm: torch.Tensor | None = None,  # [K] act-order: the kernel's row k is input channel perm[k]
) -> torch.Tensor:  # [M, N]
    if perm is not None:
        x = x.index_select(-1, perm)
    # [N, K] like nn.Linear's weight, so a float model holding the same values computes the
    # same bits (same BLAS call), which the greedy-equality tests rely on
    w = dequantize(qweight, scales, zeros, group_size, x.dtype).t().contiguous()
    return torch.nn.functional.linear(x, w, bias)
