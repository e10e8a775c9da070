"""FP8 (e4m3) weights: what config.json says, the checkpoint tensors into the layer's, the layer.

Two sources, one layer (Fp8Linear: codes [N, K] e4m3 and a float32 scale per output channel):

    --quantization fp8 of a float checkpoint   each decoder linear's weight is quantized at
                                               load, per output channel (scale = amax / 448);
                                               activations per token at run time
    quant_method: fp8 (vLLM, AutoFP8)          weight e4m3 [N, K]; weight_scale per tensor ([]
                                               or [1]) or per channel ([N] or [N, 1]);
                                               activation_scheme static adds input_scale [1]
    quant_method: compressed-tensors           the same tensors, described by config_groups:
      (format float-quantized/naive-quantized) weights num_bits 8, type float, strategy
                                               tensor|channel; input_activations dynamic
                                               (served per token) or static tensor

Experts of an FP8 checkpoint are handed to the MoE block as the float weights their codes and
scales hold (_expert_weight), which it quantizes per output channel as it does a float
checkpoint's; their input scales are dropped (the expert GEMMs read float activations).

A per-tensor weight scale is copied to every output channel of its part, which is exactly its
math, so fused qkv/gate_up parts with different scales need no requantization. A static
input_scale is kept per output channel in the same way while loading; after loading the layer
takes the largest over its fused parts (they read one activation: vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.executor.quantization.config import QuantConfig, QuantizationError
from pagedserve.kernels.fp8_reference import FP8, quantize_weight

# the decoder's linears as checkpoints name them, Phi-3's fused ones too (their rows are split
# after conversion: model._unfused)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj")


def convert_fp8(weights: Iterable[tuple[str, torch.Tensor]],
                quant: QuantConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors -> the decoder linears' `weight` (e4m3), `weight_scale` and `input_scale`
    (float32, flat); other tensors pass through."""
    seen: dict[str, set[str]] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if ".experts." in module and quant.fp8_serialized and (
                part in ("weight_scale", "input_scale") or tensor.dtype == FP8):
            if part == "input_scale":  # the expert GEMMs keep float activations
                continue
            parts = experts.setdefault(module, {})
            parts[part] = tensor
            if len(parts) == 2:
                del experts[module]
                yield f"{module}.weight", _expert_weight(module, parts)
            continue
        if module.rpartition(".")[2] not in LINEARS or ".experts." in module:
            yield name, tensor  # experts: quantized as the MoE block loads them (moe.py)
            continue
        if part == "weight_scale_inv":
            raise QuantizationError(f"{name}: block-wise FP8 scales are not supported")
        if part == "input_scale" and not quant.static_activations:
            continue  # dynamic checkpoints may carry calibration scales: unused
        if part in ("weight_scale", "input_scale"):
            seen.setdefault(module, set()).add(part)
            yield name, _flat_scale(name, tensor)
        elif part == "weight" and not quant.fp8_serialized:
            codes, scale = quantize_weight(tensor)
            yield name, codes
            yield f"{module}.weight_scale", scale
        elif part == "weight":
            if tensor.dtype != FP8:
                raise QuantizationError(f"{name} is {tensor.dtype}; an FP8 checkpoint's "
                                        "linear weights must be float8_e4m3fn")
            seen.setdefault(module, set()).add(part)
            yield name, tensor
        else:
            yield name, tensor
    for module, parts in experts.items():
        raise QuantizationError(f"{module}: checkpoint holds its {', '.join(parts)} without "
                                f"the {'weight_scale' if 'weight' in parts else 'e4m3 weight'}")
    needed = {"weight", "weight_scale"} | ({"input_scale"} if quant.static_activations else set())
    for module, parts in seen.items():
        if parts != needed:
            raise QuantizationError(f"{module}: checkpoint lacks "
                                    f"{', '.join(sorted(needed - parts))}")


def dequantize_blocks(weights: Iterable[tuple[str, torch.Tensor]],
                      block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-wise FP8 checkpoint's tensors as a float one's: each e4m3 `weight` times its
    `weight_scale_inv` (one float32 per block of rows x columns), in float32, experts
    included; activation scales (dynamic in these checkpoints) are dropped. A module's two
    parts may arrive in any order (and any file)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part == "weight_scale_inv" or (part == "weight" and tensor.dtype == FP8):
            parts = pending.setdefault(module, {})
            parts[part] = tensor
            if len(parts) == 2:
                del pending[module]
                yield f"{module}.weight", _dequantized(module, parts, block)
        elif part != "input_scale":
            yield name, tensor
    for module, parts in pending.items():
        raise QuantizationError(f"{module}: a block-wise FP8 checkpoint holds its "
                                f"{', '.join(parts)} without the "
                                f"{'weight_scale_inv' if 'weight' in parts else 'e4m3 weight'}")


def _dequantized(module: str, parts: dict[str, torch.Tensor],
                 block: tuple[int, int]) -> torch.Tensor:
    codes, scale = parts["weight"], parts["weight_scale_inv"].float()
    rows, cols = codes.shape[-2:]
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if codes.dim() != 2 or tuple(scale.shape) != want:
        raise QuantizationError(f"{module}: weight_scale_inv of shape {tuple(scale.shape)} for "
                                f"a weight of {tuple(codes.shape)} in blocks of {list(block)}; "
                                f"expected {list(want)}")
    scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return codes.float() * scale


def _expert_weight(module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """An FP8 checkpoint's expert projection as the float32 weight its codes and scale (per
    tensor or per output channel) hold: the MoE block quantizes it again per output channel
    as it loads it (moe.SparseMoe.place), the same codes where the checkpoint's scales are per
    channel, a second rounding where one scale covers the tensor."""
    codes, scale = parts["weight"], _flat_scale(f"{module}.weight_scale", parts["weight_scale"])
    if codes.dtype != FP8:
        raise QuantizationError(f"{module}.weight is {codes.dtype}; an FP8 checkpoint's expert "
                                "weights must be float8_e4m3fn")
    if scale.numel() not in (1, codes.shape[0]):
        raise QuantizationError(f"{module}.weight_scale holds {scale.numel()} scales for "
                                f"{codes.shape[0]} output channels")
    return codes.float() * scale[:, None]


def _flat_scale(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() > 2 or (t.dim() == 2 and t.shape[1] != 1):
        raise QuantizationError(f"{name}: scale of shape {tuple(t.shape)}; expected one per "
                                "tensor or one per output channel")
    return t.float().reshape(-1)


class Fp8Linear(nn.Module):
    """y = (q(x) @ W^T) * scale_x * scale_w + b with e4m3 W (kernels/fp8.py). Fused layers
    (qkv, gate_up) concatenate their parts' rows and scales."""

    fixed_dtypes = ("weight", "weight_scale", "input_scale")  # the loader casts only bias

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                 ops: Any) -> None:
        super().__init__()

        def frozen(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.weight = frozen(out_features, in_features, dtype=FP8)
        self.weight_scale = frozen(out_features, dtype=torch.float32)
        # [N] while loading (each part's scale on its rows), [1] after finish_loading
        self.input_scale = frozen(out_features, dtype=torch.float32) \
            if quant.static_activations else None
        self.bias = frozen(out_features) if bias else None
        self.ops = ops

    def finish_loading(self) -> None:
        if self.input_scale is not None:
            self.input_scale = nn.Parameter(self.input_scale.amax().reshape(1),
                                            requires_grad=False)

    def fill_random(self, gen: torch.Generator) -> None:
        """N(0, 0.02) float weights quantized as at load (benchmarks' random weights)."""
        w = torch.empty(self.weight.shape, dtype=torch.bfloat16, device=self.weight.device)
        codes, scale = quantize_weight(w.normal_(0.0, 0.02, generator=gen))
        self.weight.data.copy_(codes)
        self.weight_scale.data.copy_(scale)
        if self.input_scale is not None:
            self.input_scale.data.fill_(0.02)
        if self.bias is not None:
            self.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.fp8_gemm(x, self.weight, self.weight_scale, self.input_scale, self.bias)
