"""AWQ (GEMM) and GPTQ tensors <-> integer weights, and into the kernels' layout.

    AWQ   qweight [K, N/8] int32, 8 output columns per word in the order AWQ_ORDER
          qzeros  [K/G, N/8] int32, same packing; scales [K/G, N] fp16; W = (q - z) * s
    GPTQ  qweight [K/8, N] int32, 8 input rows per word in order (nibble j = row 8i + j)
          qzeros  [K/G, N/8] int32, columns in order, holding z - 1 (v1 format, AutoGPTQ) or z
          (gptq_v2); scales [K/G, N] fp16; g_idx [K] int32: group of input channel k

    compressed-tensors pack-quantized (int4): weight_packed [N, K/8] int32, 8 input columns
          per word in order, each value + 8; weight_scale [N, K/G]; weight_zero_point
          [N/8, K/G] int32 packed along N the same way (asymmetric; symmetric means 8);
          weight_g_idx [K] as GPTQ's; weight_shape [N, K]. W = (q - z) * s: GPTQ (v2) transposed

GPTQ's qweight is already the kernels' layout (kernels/w4a16.py). Act-order (g_idx not k // G)
is served by permuting rows so groups become contiguous: perm = argsort(g_idx), which GPTQ's
act-order makes exactly G channels per group. A last partial group (K % G != 0) is allowed
(GPTQ's ceil(K/G) groups; AutoAWQ itself needs K % G == 0, this code does not).
"""

from __future__ import annotations

import torch

from pagedserve.executor.quantization.config import QuantizationError
from pagedserve.kernels.w4a16_reference import pack_int4, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, N] ints 0..15 -> [R, N/8] int32; nibble i of word c holds column 8c + order[i]."""
    r, n = q.shape
    q = q.to(torch.int32).view(r, n // 8, 8)
    out = torch.zeros((r, n // 8), dtype=torch.int32)
    for i, col in enumerate(order):
        out |= (q[:, :, col] & 0xF) << (4 * i)
    return out


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Inverse of pack_cols: [R, N/8] int32 -> [R, N] int32 in 0..15."""
    r, c = packed.shape
    out = torch.empty((r, c, 8), dtype=torch.int32)
    for i, col in enumerate(order):
        out[:, :, col] = (packed >> (4 * i)) & 0xF
    return out.view(r, c * 8)


def _check_shapes(name, qweight_k, qweight_n, k, n, qzeros, scales, group_size):
    groups = -(-k // group_size)
    if tuple(qweight_k) != tuple(qweight_n):
        raise QuantizationError(f"{name}: qweight shape {tuple(qweight_k)}, expected "
                                f"{tuple(qweight_n)}")
    if tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // 8):
        raise QuantizationError(
            f"{name}: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not match "
            f"K={k}, N={n}, group_size {group_size} (expected ({groups}, {n}) / "
            f"({groups}, {n // 8}))")


def from_awq(name: str, qweight, qzeros, scales, group_size: int) -> dict[str, torch.Tensor]:
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_shapes(name, qweight.shape, (k, n // 8), k, n, qzeros, scales, group_size)
    if k % 8:
        raise QuantizationError(f"{name}: in_features {k} not a multiple of 8")
    q = unpack_cols(qweight, AWQ_ORDER)
    return {"qweight": pack_int4(q), "scales": scales,
            "zeros": unpack_cols(qzeros, AWQ_ORDER).to(scales.dtype)}


def from_gptq(name: str, qweight, qzeros, scales, g_idx, group_size: int, zero_offset: int,
              act_order: bool) -> dict[str, torch.Tensor]:
    n = qweight.shape[1]
    k = qweight.shape[0] * 8
    _check_shapes(name, qweight.shape, (k // 8, n), k, n, qzeros, scales, group_size)
    zeros = (unpack_cols(qzeros) + zero_offset).to(scales.dtype)
    out = {"qweight": qweight, "scales": scales, "zeros": zeros}
    trivial = torch.arange(k, dtype=torch.int64) // group_size
    g_idx = trivial if g_idx is None else g_idx.to(torch.int64)
    if g_idx.shape != (k,):
        raise QuantizationError(f"{name}: g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
    if not act_order:
        if not torch.equal(g_idx, trivial):
            raise QuantizationError(f"{name}: g_idx permutes channels but desc_act is false")
        return out
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], trivial):
        raise QuantizationError(f"{name}: g_idx groups are not {group_size} channels each")
    out["qweight"] = pack_int4(unpack_int4(qweight)[perm])
    out["perm"] = perm
    return out


def from_pack_quantized(name: str, packed, scale, shape, zero_point, g_idx, group_size: int,
                        act_order: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors' int4 tensors of one linear -> the kernels' (through from_gptq)."""
    n, k = (int(x) for x in shape.reshape(-1).tolist())
    groups = -(-k // group_size)
    if tuple(packed.shape) != (n, k // 8) or k % 8 or n % 8:
        raise QuantizationError(f"{name}: weight_packed {tuple(packed.shape)} does not hold an "
                                f"int4 weight of shape ({n}, {k}) (both multiples of 8)")
    if tuple(scale.shape) != (n, groups):
        raise QuantizationError(f"{name}: weight_scale {tuple(scale.shape)}, expected "
                                f"({n}, {groups}) for group_size {group_size}")
    scales = scale.t().contiguous()
    if zero_point is None:
        qzeros = pack_cols(torch.full((groups, n), 8, dtype=torch.int32))
    elif tuple(zero_point.shape) != (n // 8, groups):
        raise QuantizationError(f"{name}: weight_zero_point {tuple(zero_point.shape)}, "
                                f"expected ({n // 8}, {groups})")
    else:
        qzeros = zero_point.t().contiguous()
    return from_gptq(name, packed.t().contiguous(), qzeros, scales, g_idx, group_size, 0,
                     act_order)


def to_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [K, N] ints, scales/zeros [K/G, N] -> AWQ GEMM tensors (as AutoAWQ writes them)."""
    return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(zeros, AWQ_ORDER),
            "scales": scales.to(torch.float16).contiguous()}


def to_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            g_idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [K, N] ints in input-channel order, scales/zeros [K/G, N] indexed by g_idx [K] ->
    GPTQ v1 tensors (zeros stored minus one, so zeros must be 1..16)."""
    if zeros.min() < 1:
        raise ValueError("GPTQ v1 format cannot store a zero point of 0")
    return {"qweight": pack_int4(q), "qzeros": pack_cols(zeros - 1),
            "scales": scales.to(torch.float16).contiguous(), "g_idx": g_idx.to(torch.int32)}
