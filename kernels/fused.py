"""Elementwise/row kernels that fuse what torch does in several passes: RMSNorm (+ residual add),
neox rotary embedding for q and k in one launch (with Qwen3's per-head q/k RMSNorm folded in
when asked; `rotary_and_cache` also stores the rotated K and the V rows into the paged KV cache
in the same pass, the attention layer's one launch before attention), SiLU-and-mul and
GELU(tanh)-and-mul (GeGLU).
Head and hidden sizes need not be powers of two (Phi-3's head_dim 96): blocks are padded to the
next one and masked.

Rounding follows kernels.reference step by step (round to the activation dtype where torch
would), so results match the torch path to within an ulp or so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import (
    FLOAT_DTYPES,
    FP8_MAX,
    check_inner_contiguous,
    check_out,
    check_tensor,
)
from pagedserve.kernels.kv_cache import check_kv_args, fp8_saturate


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    act = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(act)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    y = (x * rstd).to(act).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual), new_residual = x + residual (or x itself)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_inner_contiguous("x", x)
    num_tokens, hidden = x.shape
    check_tensor("weight", weight, 1, FLOAT_DTYPES, x.device)
    if weight.shape[0] != hidden or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    if hidden > 65536:
        raise ValueError(f"hidden {hidden} too large for a one-row-per-program kernel")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=x.device)
    check_out("out", out, (num_tokens, hidden), out_dtype, x.device)
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,), x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        check_inner_contiguous("residual", residual)
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        check_out("residual_out", residual_out, (num_tokens, hidden), x.dtype, x.device)
    else:
        residual_out = x
    if num_tokens == 0:
        return out, residual_out
    res = residual if residual is not None else x
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, residual_out, hidden, eps,
        x.stride(0), res.stride(0), out.stride(0), residual_out.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )
    return out, residual_out


@triton.jit
def _rope_rotate(src, w_ptr, num_heads, stride_sh, cos, sin, eps,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 NORM: tl.constexpr):
    """The heads at src rotated, in fp32 (each caller rounds to its output's dtype): the two
    halves, their mask and offsets."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    head_ok = offs_h < num_heads  # and when HALF is padded to a power of two, the lanes in HALF
    mask = head_ok if BLOCK_HALF == HALF else head_ok & (offs_d < HALF)
    x1 = tl.load(src + offs_h * stride_sh + offs_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs_h * stride_sh + HALF + offs_d, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # RMSNorm over each head first, rounded as rms_norm then rotary round (Qwen3)
        act = src.dtype.element_ty
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        d_ok = offs_d < HALF
        w1 = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(act).to(tl.float32) * w1).to(act).to(tl.float32)
        x2 = ((x2 * rstd).to(act).to(tl.float32) * w2).to(act).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask, offs_h, offs_d


@triton.jit
def _rope_heads(src, dst, w_ptr, num_heads, stride_sh, stride_dh, cos, sin, eps,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                NORM: tl.constexpr):
    y1, y2, mask, offs_h, offs_d = _rope_rotate(src, w_ptr, num_heads, stride_sh, cos, sin,
                                                eps, HALF, BLOCK_HALF, BLOCK_H, NORM)
    ty = dst.dtype.element_ty
    tl.store(dst + offs_h * stride_dh + offs_d, y1.to(ty), mask=mask)
    tl.store(dst + offs_h * stride_dh + HALF + offs_d, y2.to(ty), mask=mask)


@triton.jit
def _rope_rotate_q(t, pos_ptr, q_ptr, cs_ptr, qo_ptr, qw_ptr, num_heads, stride_qt, stride_qh,
                   stride_qot, stride_qoh, stride_cs, eps, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    """Token t's cos/sin row (fp32, for its k too) and its q heads rotated into qo."""
    pos = tl.load(pos_ptr + t)
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = offs < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)
    _rope_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, qw_ptr, num_heads, stride_qh,
                stride_qoh, cos, sin, eps, HALF, BLOCK_HALF, BLOCK_H, NORM)
    return cos, sin


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HK: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _rope_rotate_q(t, pos_ptr, q_ptr, cs_ptr, qo_ptr, qw_ptr, num_heads, stride_qt,
                              stride_qh, stride_qot, stride_qoh, stride_cs, eps, HALF,
                              BLOCK_HALF, BLOCK_H, NORM)
    _rope_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, kw_ptr, num_kv_heads, stride_kh,
                stride_koh, cos, sin, eps, HALF, BLOCK_HALF, BLOCK_HK, NORM)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]
    *,
    q_out: torch.Tensor | None = None,  # pass q_out=q, k_out=k to rotate in place
    k_out: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,  # [D]: RMSNorm over each head first (Qwen3's
    k_norm_weight: torch.Tensor | None = None,  # q_norm and k_norm), with norm_eps
    norm_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k (neox); with q_norm_weight and k_norm_weight, first RMS-normalises each
    head of q and k over head_dim, rounding as reference.rms_norm does (one pass instead of a
    copy, a norm and a read of each)."""
    norm = _check_rope_args(positions, q, k, cos_sin_cache, q_norm_weight, k_norm_weight)
    num_tokens, num_heads, d = q.shape
    dev = q.device
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    if k_out is None:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=dev)
    check_out("q_out", q_out, tuple(q.shape), q.dtype, dev)
    check_out("k_out", k_out, tuple(k.shape), k.dtype, dev)
    if num_tokens == 0:
        return q_out, k_out
    _rope_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q_norm_weight if norm else q, k_norm_weight if norm else k, num_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0), float(norm_eps),
        HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2),
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), NORM=norm, num_warps=4,
    )
    return q_out, k_out


@triton.jit
def _rope_cache_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, qo_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    qw_ptr, kw_ptr, k_scale, v_scale, num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_cs, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HK: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _rope_rotate_q(t, pos_ptr, q_ptr, cs_ptr, qo_ptr, qw_ptr, num_heads, stride_qt,
                              stride_qh, stride_qot, stride_qoh, stride_cs, eps, HALF,
                              BLOCK_HALF, BLOCK_H, NORM)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding: its q is rotated (and ignored), nothing is stored
        return
    k1, k2, mask, offs_h, offs_d = _rope_rotate(k_ptr + t * stride_kt, kw_ptr, num_kv_heads,
                                                stride_kh, cos, sin, eps, HALF, BLOCK_HALF,
                                                BLOCK_HK, NORM)
    v_src = v_ptr + t * stride_vt + offs_h * stride_vh + offs_d
    v1 = tl.load(v_src, mask=mask, other=0.0)
    v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
    # rounded to the activations' dtype first, as rotary_embedding's output that
    # write_kv_cache would read (so the stored bits are the unfused pair's)
    act = k_ptr.dtype.element_ty
    k1 = k1.to(act)
    k2 = k2.to(act)
    if FP8:
        k1 = fp8_saturate(k1, k_scale, FP8_MAX)
        k2 = fp8_saturate(k2, k_scale, FP8_MAX)
        v1 = fp8_saturate(v1, v_scale, FP8_MAX)
        v2 = fp8_saturate(v2, v_scale, FP8_MAX)
    # the cache is contiguous [N, BS, Hkv, D]: a slot's rows are Hkv * D apart
    dst = slot * (num_kv_heads * 2 * HALF) + offs_h * (2 * HALF) + offs_d
    ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, k1.to(ty), mask=mask)
    tl.store(k_cache_ptr + dst + HALF, k2.to(ty), mask=mask)
    tl.store(v_cache_ptr + dst, v1.to(ty), mask=mask)
    tl.store(v_cache_ptr + dst + HALF, v2.to(ty), mask=mask)


def rotary_and_cache(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot stores nothing (padding)
    k_scale: float = 1.0,  # FP8 caches only, as write_kv_cache's
    v_scale: float = 1.0,
    *,
    q_out: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> torch.Tensor:
    """rotary_embedding, then write_kv_cache of the rotated k and of v, in one launch: returns
    the rotated q; the rotated k goes only to the cache. Same contract (and bits) as the pair."""
    norm = _check_rope_args(positions, q, k, cos_sin_cache, q_norm_weight, k_norm_weight)
    fp8 = check_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if v.dtype != q.dtype:
        raise ValueError(f"v dtype {v.dtype} != q dtype {q.dtype}")
    num_tokens, num_heads, d = q.shape
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check_out("q_out", q_out, tuple(q.shape), q.dtype, q.device)
    if num_tokens == 0:
        return q_out
    _rope_cache_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, q_out, k_cache, v_cache, slot_mapping,
        q_norm_weight if norm else q, k_norm_weight if norm else k,
        float(k_scale), float(v_scale), num_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0), float(norm_eps),
        HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2),
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), NORM=norm, FP8=fp8, FP8_MAX=FP8_MAX,
        num_warps=4,
    )
    return q_out


def _check_rope_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, q_w: torch.Tensor | None,
                     k_w: torch.Tensor | None) -> bool:
    """Checks rotary_embedding's inputs; whether the heads are normalised first."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    check_tensor("k", k, 3, (q.dtype,), dev)
    check_tensor("positions", positions, 1, (torch.int64,), dev)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES, dev)
    num_tokens, _, d = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != d or positions.shape[0] != num_tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                         f"{tuple(positions.shape)} disagree on tokens or head_dim")
    if cos_sin_cache.shape[1] != d or d < 2 or d % 2:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal head_dim {d}, "
                         "an even number")
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_inner_contiguous(name, t)
    return _check_norm_weights(q, q_w, k_w)


def _check_norm_weights(q: torch.Tensor, q_w: torch.Tensor | None,
                        k_w: torch.Tensor | None) -> bool:
    """Whether the heads are normalised first: both weights or neither, each contiguous [D]
    of q's dtype (the norm's output dtype, as rms_norm's, is then q's)."""
    if (q_w is None) != (k_w is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    if q_w is None:
        return False
    d = q.shape[2]
    for name, w in (("q_norm_weight", q_w), ("k_norm_weight", k_w)):
        check_tensor(name, w, 1, (q.dtype,), q.device)
        if w.shape[0] != d or w.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous [{d}], got {tuple(w.shape)}")
    return True


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    act = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(act).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    act = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2 / pi) (g + 0.044715 g^3): torch's
    # approximate="tanh" (the interpreter has no libdevice tanh; this needs none). The sigmoid
    # from exp(-|2z|), which cannot overflow.
    z2 = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2z
    e = tl.exp(-tl.abs(z2))
    s = (g * tl.where(z2 >= 0, 1.0, e) / (1.0 + e)).to(act).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2I]
    *,
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    return _gated(_silu_and_mul_kernel, x, out)


def gelu_tanh_and_mul(
    x: torch.Tensor,  # [T, 2I]
    *,
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, approximate="tanh") * up, gate the first half of each row."""
    return _gated(_gelu_tanh_and_mul_kernel, x, out)


def _gated(kernel, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_inner_contiguous("x", x)
    num_tokens, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"last dim of x must be even, got {two_i}")
    inter = two_i // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    check_out("out", out, (num_tokens, inter), x.dtype, x.device)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(2048, triton.next_power_of_2(inter))
    kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
    )
    return out
