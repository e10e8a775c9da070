"""compressed-tensors' integer weights that the 4-bit kernels do not take, dequantized at load:
8-bit ones (llm-compressor's W8A8 `int-quantized`, W8A16 `pack-quantized`, `naive-quantized`)
and 4-bit ones with a scale per channel or per tensor, or with quantized activations. Each
quantized module's tensors become its float32 `weight`, so the model loads them as a float
checkpoint's (quantized again to FP8 per output channel with --quantization fp8).

    weight           [N, K] int8 (int-quantized, naive-quantized), signed
    weight_packed    [N, ceil(K * bits / 32)] int32 (pack-quantized): 32 / bits values a word
                     along K, lowest bits first, each value + 2^(bits - 1); weight_shape [N, K]
    weight_scale     [] or [1] per tensor, [N, 1] per channel, [N, K / G] per group of G
    weight_zero_point  asymmetric only: as the scale (int-quantized), or packed along N as the
                     weight along K (pack-quantized)
    weight_g_idx     [K]: group of input channel k (activation order "group")

W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]. The 4-bit GPTQ-shaped ones (group 32/64/128,
float activations) stay 4-bit: quantization/formats.py, from_pack_quantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.executor.quantization.config import IntWeights, QuantizationError

_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")
_DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")


def dequantize_int(weights: Iterable[tuple[str, torch.Tensor]],
                   scheme: IntWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized module's as its float32 `weight`;
    activation scales dropped (the layers read float activations). A module's parts may
    arrive in any order (and any file)."""
    needed = {"weight_scale"} | ({"weight_zero_point"} if not scheme.sym else set()) \
        | ({"weight_g_idx"} if scheme.act_order else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part in _DROPPED:
            continue
        if part in _PARTS or (part == "weight" and tensor.dtype == torch.int8):
            if part == "weight_zero_point" and scheme.sym:
                continue  # zero, whatever was saved
            parts = pending.setdefault(module, {})
            parts[part] = tensor
            has_weight = "weight" in parts or {"weight_packed", "weight_shape"} <= set(parts)
            if has_weight and needed <= set(parts):
                del pending[module]
                yield f"{module}.weight", _dequantized(module, parts, scheme)
            continue
        yield name, tensor
    for module, parts in pending.items():
        raise QuantizationError(f"{module}: checkpoint holds its {', '.join(sorted(parts))} "
                                "without the rest of an integer weight")


def unpack(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """[R, C] int32 words of `bits`-bit unsigned values along the last dimension, lowest bits
    first -> [R, length] int32, signed (value - 2^(bits - 1))."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    u = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return u.reshape(*packed.shape[:-1], -1)[..., :length] - (1 << (bits - 1))


def _dequantized(module: str, p: dict[str, torch.Tensor], scheme: IntWeights) -> torch.Tensor:
    if "weight" in p:
        q = p["weight"].to(torch.int32)
    else:
        n, k = (int(x) for x in p["weight_shape"].reshape(-1).tolist())
        if p["weight_packed"].shape != (n, -(-k * scheme.bits // 32)):
            raise QuantizationError(f"{module}: weight_packed {tuple(p['weight_packed'].shape)} "
                                    f"does not hold {scheme.bits}-bit weights of ({n}, {k})")
        q = unpack(p["weight_packed"], scheme.bits, k)
    n, k = q.shape
    scale = p["weight_scale"].float()
    if scale.numel() == 1:  # per tensor
        scale = scale.reshape(1, 1).expand(n, 1)
    if scale.dim() != 2 or scale.shape[0] != n:
        raise QuantizationError(f"{module}: weight_scale {tuple(p['weight_scale'].shape)} for "
                                f"a weight of ({n}, {k})")
    groups = scale.shape[1]
    zero = torch.zeros(n, 1)
    if not scheme.sym:
        zero = p["weight_zero_point"]
        if zero.dtype == torch.int32 and "weight_packed" in p:  # packed along N
            zero = unpack(zero.t(), scheme.bits, n).t()
        if zero.numel() == 1:
            zero = zero.reshape(1, 1).expand(n, 1)
        if zero.shape != (n, groups):
            raise QuantizationError(f"{module}: weight_zero_point {tuple(zero.shape)}, "
                                    f"expected ({n}, {groups})")
        zero = zero.float()
    if groups == 1:
        g = torch.zeros(k, dtype=torch.long)
    elif "weight_g_idx" in p:
        g = p["weight_g_idx"].long()
    else:
        g = torch.arange(k) // scheme.group_size
    if g.shape != (k,) or g.max() >= groups:
        raise QuantizationError(f"{module}: {groups} scale groups do not cover {k} input "
                                f"channels (group_size {scheme.group_size})")
    return (q.float() - zero[:, g]) * scale[:, g]
