"""Scatter this step's K/V rows into the paged cache (one program per token).

An FP8 cache (float8_e4m3fn) stores saturate(x / scale) with one scale for K and one for V
(per layer; kernels/_checks.py); other caches store x cast to their dtype and ignore the scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    FP8_MAX,
    KV_DTYPES,
    check_contiguous,
    check_inner_contiguous,
    check_tensor,
)


@triton.jit
def fp8_saturate(x, scale, FP8_MAX: tl.constexpr):
    """x / scale in fp32, clamped to the e4m3 range: an FP8 cache's value before the store's cast
    (write_kv_cache's and rotary_and_cache's)."""
    # divide (not multiply by 1/scale): the reference does the same, so the bits match
    x = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < num_kv_heads) & (offs_d < head_dim)
    k = tl.load(key_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    if FP8:
        k = fp8_saturate(k, k_scale, FP8_MAX)
        v = fp8_saturate(v, v_scale, FP8_MAX)
    # Cache is contiguous [N, BS, Hkv, D]: a slot's rows are Hkv*D apart.
    dst = slot * (num_kv_heads * head_dim) + offs_h * head_dim + offs_d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float,
                  v_scale: float) -> bool:
    """Checks write_kv_cache's arguments (rotary_and_cache's too); whether the cache is FP8."""
    check_tensor("k_cache", k_cache, 4, KV_DTYPES)
    dev = k_cache.device
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), dev)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    _, _, hkv, d = k_cache.shape
    check_tensor("key", key, 3, FLOAT_DTYPES, dev)
    check_tensor("value", value, 3, FLOAT_DTYPES, dev)
    num_tokens = key.shape[0]
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != (num_tokens, hkv, d):
            raise ValueError(f"{name} shape {tuple(t.shape)} != {(num_tokens, hkv, d)}")
        check_inner_contiguous(name, t)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), dev)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, want {num_tokens}")
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    if fp8 and not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"FP8 KV scales must be > 0, got k_scale {k_scale}, v_scale {v_scale}")
    return fp8


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; negative = skip
    k_scale: float = 1.0,  # FP8 caches only: stored = saturate(key / k_scale)
    v_scale: float = 1.0,
) -> None:
    fp8 = check_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, hkv, d = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        hkv, d,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        FP8=fp8, FP8_MAX=FP8_MAX,
    )
