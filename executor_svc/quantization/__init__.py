"""Quantized weights: 4-bit AWQ/GPTQ/compressed-tensors checkpoint loading (config, formats,
layer) and the algorithms behind `pagedserve quantize` (rtn, awq, gptq, pipeline); FP8 weights
(fp8); integer weights the 4-bit kernels do not take, dequantized at load (dequantized)."""

from pagedserve.executor.quantization.config import (
           QuantConfig,
           QuantizationError,
           resolve_quantization,
)
from pagedserve.executor.quantization.fp8 import Fp8Linear
from pagedserve.executor.quantization.layer import W4Linear, convert_checkpoint

__all__ = ["Fp8Linear", "QuantConfig", "QuantizationError", "W4Linear", "convert_checkpoint",
           "resolve_quantization"]
