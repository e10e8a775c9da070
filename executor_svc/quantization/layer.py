"""The quantized linear layer and the checkpoint conversion that feeds it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.executor.quantization.config import QuantConfig, QuantizationError
from pagedserve.executor.quantization.formats import (
    from_awq,
    from_gptq,
    from_pack_quantized,
)
from pagedserve.executor.quantization.fp8 import convert_fp8
from pagedserve.kernels.w4a16_reference import dequantize

_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales")}


class W4Linear(nn.Module):
    """y = x @ dequant(W) + b, with W in the kernels' layout (kernels/w4a16.py). Fused layers
    (qkv, gate_up) concatenate their parts along N; act-order parts must share one perm."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                 ops: Any) -> None:
        super().__init__()
        if in_features % 8 or out_features % 8:
            raise QuantizationError(f"a {in_features}x{out_features} linear cannot be packed "
                                    "in 4 bits (both sizes must be multiples of 8)")
        groups = -(-in_features // quant.group_size)

        def frozen(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.qweight = frozen(in_features // 8, out_features, dtype=torch.int32)
        self.scales = frozen(groups, out_features)
        self.zeros = frozen(groups, out_features)
        self.perm = frozen(in_features, dtype=torch.int64) if quant.act_order else None
        self.bias = frozen(out_features) if bias else None
        self.group_size, self.ops = quant.group_size, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.w4a16_gemm(x, self.qweight, self.scales, self.zeros, self.group_size,
                                   self.bias, self.perm)


# one expert's projection of a mixture-of-experts layer, as hub checkpoints name it
_EXPERT = re.compile(r"\.(?:block_sparse_moe|mlp)\.experts\.\d+\."
                     r"(?:w1|w2|w3|gate_proj|up_proj|down_proj)$")


def convert_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF AWQ/GPTQ tensors -> `<module>.qweight/.scales/.zeros[/.perm]` in the kernels' layout;
    other tensors pass through. A module's parts may arrive in any order (and any file).
    An expert's projection becomes its dequantized `<module>.weight` [out, in] in float32:
    mixture-of-experts layers serve 4-bit checkpoints' experts in float (moe.SparseMoe).
    FP8: quantization.fp8.convert_fp8."""
    if quant.method == "fp8":
        yield from convert_fp8(weights, quant)
        return
    for module, tensors in _convert_modules(weights, quant):
        if not module:
            yield from tensors.items()
        elif _EXPERT.search(module):
            yield f"{module}.weight", _dequantized(tensors, quant.group_size)
        else:
            yield from ((f"{module}.{k}", v) for k, v in tensors.items())


def _dequantized(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """The kernels' tensors of one linear -> its float32 weight [out, in], rows of an
    act-order weight back in input-channel order."""
    w = dequantize(t["qweight"], t["scales"], t["zeros"], group_size, torch.float32)
    if "perm" in t:  # row i of the kernels' weight is input channel perm[i]
        w = torch.empty_like(w).index_copy_(0, t["perm"], w)
    return w.t().contiguous()


def _convert_modules(
    weights: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(module, its tensors in the kernels' layout) for each quantized module, ("", {name:
    tensor}) for every other tensor."""
    if quant.packing == "pack-quantized":  # compressed-tensors' names
        needed = ("weight_packed", "weight_scale", "weight_shape") \
            + (() if quant.sym else ("weight_zero_point",)) \
            + (("weight_g_idx",) if quant.act_order else ())
        # a symmetric zero point is zero, whatever was saved; a weight_g_idx without
        # actorder "group" passes through, to be refused at load
        dropped = ("weight_zero_point",) if quant.sym else ()
        for module, parts, whole in gathered(weights, needed, dropped):
            if module and not whole:
                missing = sorted(set(needed) - set(parts))
                raise QuantizationError(f"{module}: checkpoint lacks {', '.join(missing)}")
            yield module, parts if not module else from_pack_quantized(
                module, parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                parts.get("weight_zero_point"), parts.get("weight_g_idx"), quant.group_size,
                quant.act_order)
        return
    needed = _PARTS[quant.method] + (("g_idx",) if quant.method == "gptq" else ())
    for module, parts, whole in gathered(weights, needed):
        if module and not whole and not (  # g_idx is optional without act-order
                quant.method == "gptq" and not quant.act_order
                and set(parts) == set(_PARTS["gptq"])):
            missing = sorted(set(needed) - set(parts))
            raise QuantizationError(f"{module}: checkpoint lacks {', '.join(missing)}")
        yield module, parts if not module else _convert(module, parts, quant)


def _module_and_part(name: str) -> tuple[str, str]:
    module, _, part = name.rpartition(".")
    return module, part


def gathered(weights: Iterable[tuple[str, torch.Tensor]], needed: tuple[str, ...],
             dropped: tuple[str, ...] = (),
             split: Callable[[str], tuple[str, str]] = _module_and_part,
             ) -> Iterator[tuple[str, dict[str, torch.Tensor], bool]]:
    """Each quantized module's parts (`needed`, in any order and any file) as (module,
    parts, True) once all have come, and as (module, parts, False) at the end for a module
    still short of some; ("", {name: tensor}, True) for every other tensor; names ending in
    a `dropped` part are left out. `split` cuts a name into (module, part): by its last dot
    unless given (MXFP4's `<name>_blocks` has none)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, part = split(name)
        if part in dropped:
            continue
        if part not in needed:
            yield "", {name: tensor}, True
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if all(p in parts for p in needed):
            del pending[module]
            yield module, parts, True
    for module, parts in pending.items():
        yield module, parts, False


def _convert(module: str, p: dict[str, torch.Tensor], quant: QuantConfig) -> dict:
    if quant.method == "awq":
        return from_awq(module, p["qweight"], p["qzeros"], p["scales"], quant.group_size)
    return from_gptq(module, p["qweight"], p["qzeros"], p["scales"], p.get("g_idx"),
                     quant.group_size, quant.zero_offset, quant.act_order)
