"""FP8 (e4m3) W8A8 GEMM: per-token activation quantization (a Triton kernel on CUDA) and
torch._scaled_mm with row-wise scales (scale_a [M, 1] per token, scale_b [1, N] per output
channel, fp32 accumulation) where the device has FP8 tensor cores (compute capability 8.9+).
Elsewhere, including GPUs without FP8, the float emulation of kernels/fp8_reference.

The quantization kernel reads each row twice (amax, then codes: the second read hits L2) and
writes codes and one fp32 scale per row, one program per row: it replaces five elementwise torch
ops with fp32 intermediates. Codes equal fp8_reference.quantize_per_token's (same division,
same round-to-nearest-even conversion).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8_reference import FP8, FP8_MAX, MIN_SCALE, quantize_static
from pagedserve.kernels.fp8_reference import fp8_gemm as emulated
from pagedserve.kernels.fp8_reference import quantize_per_token as quantize_per_token_torch

QUANT_BLOCK = 1024


@triton.jit
def _quant_row_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                      FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k + offs, mask=k + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_C, MIN_SCALE_C)
    for k in range(0, K, BLOCK):
        mask = k + offs < K
        x = tl.load(x_ptr + row * stride_x + k + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + k + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (codes [M, K] e4m3, scale [M, 1] float32)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quant_row_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX, MIN_SCALE,
                                BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(k)))
    return q, s


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token_triton(x) if x.is_cuda else quantize_per_token_torch(x)


@functools.cache
def has_scaled_mm(device: torch.device) -> bool:
    """Row-wise torch._scaled_mm: CUDA compute capability 8.9+ (Ada, Hopper), or the CPU where
    this torch implements row-wise scales (2.13 does; 2.11's CPU kernel takes per-tensor
    scales only, so it is probed once). Tests run the production call on such a CPU; the CPU
    service uses the faster emulation, kernels.get_ops("torch")."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    if device.type != "cpu":
        return False
    a = torch.zeros((16, 16), dtype=FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)),
                         out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def fp8_gemm(
    x: torch.Tensor,  # [M, K] float activations
    weight: torch.Tensor,  # [N, K] e4m3, row-major: weight.t() is the column-major operand
    weight_scale: torch.Tensor,  # [N] float32
    input_scale: torch.Tensor | None = None,  # [1] static activation scale; None: per token
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x.dtype
    n, k = weight.shape
    # _scaled_mm needs both sizes multiples of 16 (the FP8 MMA's K step, 16-byte rows)
    if not has_scaled_mm(x.device) or k % 16 or n % 16:
        return emulated(x, weight, weight_scale, input_scale, bias)
    if input_scale is None:
        xq, sa = quantize_per_token(x)
    else:
        xq, sa = quantize_static(x, input_scale)
        sa = sa.contiguous()
    # CUDA's row-wise scaling writes bf16 only; fp16/fp32 models cast the result
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=sa, scale_b=weight_scale[None, :],
                         out_dtype=out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
