"""Integer checkpoints the 4-bit kernels do not take, dequantized at load: each quantized
module's tensors become its float32 `weight`, so the model loads them as a float checkpoint's
(quantized again to FP8 per output channel with --quantization fp8). Which ones:
config.dequantized_int. Two layouts:

compressed-tensors (8-bit W8A8 `int-quantized`, W8A16 `pack-quantized`, `naive-quantized`;
2/4-bit ones with a scale per channel or tensor, or with quantized activations):
    weight           [N, K] int8 (int-quantized, naive-quantized), signed
    weight_packed    [N, ceil(K * bits / 32)] int32 (pack-quantized): 32 / bits values a word
                     along K, lowest bits first, each value + 2^(bits - 1); weight_shape [N, K]
    weight_scale     [] or [1] per tensor, [N, 1] per channel, [N, K / G] per group of G
    weight_zero_point  asymmetric only: as the scale (int-quantized), or packed along N as the
                     weight along K (pack-quantized)
    weight_g_idx     [K]: group of input channel k (activation order "group")

GPTQ (AutoGPTQ, GPTQModel: 8-bit, as Qwen's GPTQ-Int8 releases, or 2/4-bit with a group size
the kernels do not take, -1 for one group per channel):
    qweight [K * bits / 32, N] int32, 32 / bits input rows a word, lowest bits first, unsigned
    qzeros [G, N * bits / 32] int32 packed along N the same way, holding z - 1 (checkpoint
    format gptq) or z (gptq_v2); scales [G, N]; g_idx [K] (optional without act-order)

W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]. The 4-bit GPTQ-shaped ones (group 32/64/128,
float activations) stay 4-bit: quantization/formats.py.

bitsandbytes (as transformers saves a model loaded with load_in_4bit or load_in_8bit):
    4-bit  weight [N * K / 2, 1] uint8, two codes a byte (high nibble first), over the weight
           flattened row-major; weight.quant_map [16] (NF4's or FP4's values); weight.absmax
           one per block of `blocksize` codes, float32, or with double quantization uint8
           codes of weight.nested_quant_map [256] times weight.nested_absmax (one per
           `nested_blocksize`) plus `nested_offset`; weight.quant_state.bitsandbytes__nf4
           (or __fp4): those sizes and the shape, as JSON bytes. W = quant_map[code] * absmax
    8-bit  weight [N, K] int8 and SCB [N]: W = weight * SCB / 127
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator

import torch

from pagedserve.executor.quantization.config import IntWeights, QuantizationError

_CT_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
             "weight_g_idx")
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")


def dequantize_int(weights: Iterable[tuple[str, torch.Tensor]],
                   scheme: IntWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized module's as its float32 `weight`;
    activation scales dropped (the layers read float activations). A module's parts may
    arrive in any order (and any file)."""
    if scheme.layout == "bitsandbytes":
        yield from _dequantize_bnb(weights)
        return
    gptq = scheme.layout == "gptq"
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part in _DROPPED:
            continue
        if part == "weight_zero_point" and scheme.sym:
            continue  # zero, whatever was saved
        ours = part in _GPTQ_PARTS if gptq else (
            part in _CT_PARTS or (part == "weight" and tensor.dtype == torch.int8))
        if not ours:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if _complete(parts, scheme, need_g_idx=scheme.act_order):
            del pending[module]
            yield f"{module}.weight", _dequantized(module, parts, scheme)
    for module, parts in pending.items():  # GPTQ's g_idx is optional without act-order
        if not _complete(parts, scheme, need_g_idx=scheme.act_order or not gptq):
            raise QuantizationError(f"{module}: checkpoint holds its "
                                    f"{', '.join(sorted(parts))} without the rest of an "
                                    "integer weight")
        yield f"{module}.weight", _dequantized(module, parts, scheme)


def _complete(parts: dict[str, torch.Tensor], scheme: IntWeights, need_g_idx: bool) -> bool:
    if scheme.layout == "gptq":
        needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if need_g_idx else set())
        return needed <= set(parts)
    needed = {"weight_scale"} | ({"weight_zero_point"} if not scheme.sym else set()) \
        | ({"weight_g_idx"} if scheme.act_order else set())
    weight = "weight" in parts or {"weight_packed", "weight_shape"} <= set(parts)
    return weight and needed <= set(parts)


def unpack(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """[R, C] int32 words of `bits`-bit unsigned values along the last dimension, lowest bits
    first -> [R, length] int32, unsigned."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    u = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return u.reshape(*packed.shape[:-1], -1)[..., :length]


def _dequantized(module: str, p: dict[str, torch.Tensor], scheme: IntWeights) -> torch.Tensor:
    """[N, K] float32 from one module's parts."""
    if scheme.layout == "gptq":
        q, scale, zero = _gptq(module, p, scheme)
    else:
        q, scale, zero = _compressed(module, p, scheme)
    n, k = q.shape
    groups = scale.shape[1]
    g_idx = p.get("g_idx", p.get("weight_g_idx"))
    if groups == 1:
        g = torch.zeros(k, dtype=torch.long)
    elif g_idx is not None:
        g = g_idx.long()
    else:
        g = torch.arange(k) // scheme.group_size
    if g.shape != (k,) or int(g.max()) >= groups:
        raise QuantizationError(f"{module}: {groups} scale groups do not cover {k} input "
                                f"channels (group_size {scheme.group_size})")
    return (q.float() - zero[:, g]) * scale[:, g]


def _compressed(module: str, p: dict[str, torch.Tensor], scheme: IntWeights
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] signed, scale [N, G], zero [N, G]) of compressed-tensors' parts."""
    half = 1 << (scheme.bits - 1)
    if "weight" in p:
        q = p["weight"].to(torch.int32)
    else:
        n, k = (int(x) for x in p["weight_shape"].reshape(-1).tolist())
        if p["weight_packed"].shape != (n, -(-k * scheme.bits // 32)):
            raise QuantizationError(f"{module}: weight_packed {tuple(p['weight_packed'].shape)} "
                                    f"does not hold {scheme.bits}-bit weights of ({n}, {k})")
        q = unpack(p["weight_packed"], scheme.bits, k) - half
    n, k = q.shape
    scale = p["weight_scale"].float()
    if scale.numel() == 1:  # per tensor
        scale = scale.reshape(1, 1).expand(n, 1)
    if scale.dim() != 2 or scale.shape[0] != n:
        raise QuantizationError(f"{module}: weight_scale {tuple(p['weight_scale'].shape)} for "
                                f"a weight of ({n}, {k})")
    zero = torch.zeros(n, scale.shape[1])
    if not scheme.sym:
        zero = p["weight_zero_point"]
        if zero.dtype == torch.int32 and "weight_packed" in p:  # packed along N
            zero = unpack(zero.t(), scheme.bits, n).t() - half
        if zero.numel() == 1:
            zero = zero.reshape(1, 1).expand(n, 1)
        if zero.shape != scale.shape:
            raise QuantizationError(f"{module}: weight_zero_point {tuple(zero.shape)}, "
                                    f"expected {tuple(scale.shape)}")
        zero = zero.float()
    return q, scale, zero


def _gptq(module: str, p: dict[str, torch.Tensor], scheme: IntWeights
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [N, G], zero [N, G]) of GPTQ's parts, zeros as stored + offset."""
    scales = p["scales"].float()
    groups, n = scales.shape
    per = 32 // scheme.bits
    k = p["qweight"].shape[0] * per
    if p["qweight"].shape[1] != n or p["qzeros"].shape != (groups, -(-n // per)):
        raise QuantizationError(f"{module}: qweight {tuple(p['qweight'].shape)}, qzeros "
                                f"{tuple(p['qzeros'].shape)} and scales {(groups, n)} do not "
                                f"hold {scheme.bits}-bit weights")
    q = unpack(p["qweight"].t(), scheme.bits, k)  # [N, K]
    zero = unpack(p["qzeros"], scheme.bits, n).t().float() + scheme.zero_offset  # [N, G]
    return q, scales.t(), zero


_BNB_4BIT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def _dequantize_bnb(weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name.endswith(".SCB") or name.endswith(".weight_format"):
            module, _, part = name.rpartition(".")
        elif ".weight." in name:  # weight.absmax, weight.quant_state.bitsandbytes__nf4, ...
            module, _, part = name.partition(".weight.")
        elif name.endswith(".weight") and tensor.dtype in (torch.uint8, torch.int8):
            module, part = name.removesuffix(".weight"), "weight"
        else:
            yield name, tensor
            continue
        if part == "weight_format":
            continue  # how the int8 weight was laid out for the GPU kernels: row here
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        state = next((v for k, v in parts.items() if k.startswith("quant_state.")), None)
        if "weight" not in parts:
            continue
        if parts["weight"].dtype == torch.int8 and "SCB" in parts:
            del pending[module]
            scale = parts["SCB"].float()[:, None] / 127
            yield f"{module}.weight", parts["weight"].float() * scale
        elif state is not None:
            meta = json.loads(bytes(state.to(torch.uint8).tolist()).decode())
            nested = "nested_blocksize" in meta
            if {"absmax", "quant_map"} <= set(parts) and (
                    not nested or {"nested_absmax", "nested_quant_map"} <= set(parts)):
                del pending[module]
                yield f"{module}.weight", _bnb_4bit(module, parts, meta)
    for module, parts in pending.items():
        raise QuantizationError(f"{module}: checkpoint holds its {', '.join(sorted(parts))} "
                                "without the rest of a bitsandbytes weight")


def _bnb_4bit(module: str, p: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    shape = [int(x) for x in meta["shape"]]
    n, block = math.prod(shape), int(meta["blocksize"])
    packed = p["weight"].view(torch.uint8).reshape(-1).to(torch.int64)
    if packed.numel() * 2 < n:
        raise QuantizationError(f"{module}: {packed.numel()} bytes hold no weight of {shape}")
    codes = torch.stack([packed >> 4, packed & 0xF], 1).reshape(-1)[:n]
    absmax = p["absmax"]
    if "nested_blocksize" in meta:
        nb = int(meta["nested_blocksize"])
        absmax = p["nested_quant_map"].float()[absmax.to(torch.int64)]
        scale = p["nested_absmax"].float().repeat_interleave(nb)[:absmax.numel()]
        absmax = absmax * scale + float(meta.get("nested_offset", 0.0))
    absmax = absmax.float().repeat_interleave(block)[:n]
    if absmax.numel() != n:
        raise QuantizationError(f"{module}: {p['absmax'].numel()} absmax values do not cover "
                                f"{n} weights in blocks of {block}")
    return (p["quant_map"].float()[codes] * absmax).reshape(shape)
