"""Argument checks shared by the Triton launchers: misuse raises ValueError, never a bad launch."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# An FP8 KV cache (--kv-cache-dtype fp8) stores e4m3 with a scale per layer for K and for V:
# stored = saturate(x / scale) to +-FP8_MAX, read back as stored * scale.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
KV_DTYPES = (*FLOAT_DTYPES, FP8_KV_DTYPE)


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype {t.dtype} not in {dtypes}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} shape {tuple(t.shape)} != expected {tuple(shape)}")


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    """Last dim unit-stride: rows may be strided views (e.g. slices of a fused qkv)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_out(name: str, out: torch.Tensor, like_shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> None:
    check_tensor(name, out, len(like_shape), (dtype,), device)
    check_shape(name, out, like_shape)
    check_inner_contiguous(name, out)
