"""Model kernels: torch reference ops (CPU path, test oracle) and their Triton versions.

``get_ops("torch" | "triton")`` returns a namespace with write_kv_cache, paged_attention,
rms_norm, rotary_embedding, silu_and_mul, gelu_tanh_and_mul, w4a16_gemm (4-bit weights; its
torch version lives in w4a16_reference) and the sampler's exponential_race (its torch version in
sampling_reference). Submodules import lazily, so importing the package costs nothing until an
op is asked for. fp8_gemm (FP8 weights and activations) has its torch
version in fp8_reference.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

_OP_MODULES = {
    "write_kv_cache": "kv_cache",
    "paged_attention": "paged_attention",
    "rms_norm": "fused",
    "rotary_embedding": "fused",
    "silu_and_mul": "fused",
    "gelu_tanh_and_mul": "fused",
    "w4a16_gemm": "w4a16",
    "fp8_gemm": "fp8",
    # mixture of experts (layout and the torch path: moe_reference)
    "moe_route": "fused_moe",
    "fused_moe": "fused_moe",
    # the sampler's draw (its generator and the torch path: sampling_reference)
    "exponential_race": "sampling",
}
_TORCH_MODULES = {"w4a16_gemm": "w4a16_reference",  # default: reference
                  "fp8_gemm": "fp8_reference",
                  "moe_route": "moe_reference",
                  "fused_moe": "moe_reference",
                  "exponential_race": "sampling_reference"}


def get_ops(backend: str) -> SimpleNamespace:
    if backend == "torch":
        modules = {op: _TORCH_MODULES.get(op, "reference") for op in _OP_MODULES}
    elif backend == "triton":
        modules = _OP_MODULES
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
    return SimpleNamespace(**{op: getattr(importlib.import_module(f"{__name__}.{m}"), op)
                              for op, m in modules.items()})
