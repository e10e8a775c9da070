"""4-bit weight-only quantization: AWQ/GPTQ checkpoint loading (config, formats, layer) and the
algorithms behind `pagedserve quantize` (rtn, awq, gptq, pipeline)."""

from pagedserve.executor.quantization.config import (
           QuantConfig,
           QuantizationError,
           resolve_quantization,
)
from pagedserve.executor.quantization.layer import W4Linear, convert_checkpoint

__all__ = ["QuantConfig", "QuantizationError", "W4Linear", "convert_checkpoint",
           "resolve_quantization"]
