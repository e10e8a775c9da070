"""FP8 (e4m3) W8A8 in torch: per-channel weight and per-token activation quantization, and the
GEMM as float math on the quantized values (the CPU path and the test oracle of kernels/fp8.py).

A product of two e4m3 values has at most 8 significant bits, so the float32 matmul of the
dequantized-to-float32 codes computes what the FP8 tensor cores do: exact products summed in
float32 (in another order), then scaled by scale_a[m] * scale_b[n]."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros, not NaN


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes [N, K] e4m3, scale [N] float32): per output channel,
    scale = amax / 448, codes = w / scale rounded to nearest even."""
    w = w.float()
    scale = (w.abs().amax(1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] e4m3, scale [M, 1] float32), scale = amax of the row / 448."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with one checkpoint scale [1] -> (codes [M, K], scale [M, 1] float32)."""
    s = scale.float().reshape(1, 1)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s.expand(x.shape[0], 1)


def quantize_input(x: torch.Tensor, input_scale: torch.Tensor | None):
    return quantize_per_token(x) if input_scale is None else quantize_static(x, input_scale)


def fp8_gemm(
    x: torch.Tensor,  # [M, K] float activations
    weight: torch.Tensor,  # [N, K] e4m3 (nn.Linear's layout)
    weight_scale: torch.Tensor,  # [N] float32
    input_scale: torch.Tensor | None = None,  # [1] static activation scale; None: per token
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x.dtype
    xq, sa = quantize_input(x, input_scale)
    y = (xq.float() @ weight.float().t()) * (sa * weight_scale.float()[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
