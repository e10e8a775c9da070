"""Model kernels: torch reference ops (CPU path, test oracle) and their Triton versions.

``get_ops("torch" | "triton")`` returns a namespace with write_kv_cache, paged_attention,
rms_norm, rotary_embedding, rotary_and_cache (the two before attention in one), silu_and_mul,
gelu_tanh_and_mul, w4a16_gemm (4-bit weights; its torch version lives in w4a16_reference) and
the sampler's exponential_race (its torch version in sampling_reference). Submodules import
lazily, so importing the package costs nothing until an op is asked for. fp8_gemm (FP8 weights
and activations) has its torch version in fp8_reference. lora_shrink and lora_expand
(multi-LoRA, segment-grouped) have theirs in lora_reference.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import SimpleNamespace


def _yield_top_level_name() -> None:
    """Run from a checkout's root (``python -m pytest``, ``python -m benchmarks...``), this folder
    is on sys.path as a top-level ``kernels`` and shadows Hugging Face's PyPI package of that name,
    which transformers (>= 5.25 requires it) imports. Under that name, hand the import over to the
    installed package; installed, ours is only ever ``pagedserve.kernels``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return  # nothing else is installed under the name: stay (transformers sees no version)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _yield_top_level_name()

_OP_MODULES = {
    "write_kv_cache": "kv_cache",
    "paged_attention": "paged_attention",
    "rms_norm": "fused",
    "rotary_embedding": "fused",
    "rotary_and_cache": "fused",
    "silu_and_mul": "fused",
    "gelu_tanh_and_mul": "fused",
    "w4a16_gemm": "w4a16",
    "fp8_gemm": "fp8",
    # mixture of experts (layout and the torch path: moe_reference)
    "moe_route": "fused_moe",
    "fused_moe": "fused_moe",
    "routed_moe": "fused_moe",
    # the sampler's draw (its generator and the torch path: sampling_reference)
    "exponential_race": "sampling",
    # multi-LoRA over a step's segments (layout and the torch path: lora_reference)
    "lora_shrink": "lora",
    "lora_expand": "lora",
}
_TORCH_MODULES = {"w4a16_gemm": "w4a16_reference",  # default: reference
                  "fp8_gemm": "fp8_reference",
                  "moe_route": "moe_reference",
                  "fused_moe": "moe_reference",
                  "routed_moe": "moe_reference",
                  "exponential_race": "sampling_reference",
                  "lora_shrink": "lora_reference",
                  "lora_expand": "lora_reference"}


def get_ops(backend: str) -> SimpleNamespace:
    if backend == "torch":
        modules = {op: _TORCH_MODULES.get(op, "reference") for op in _OP_MODULES}
    elif backend == "triton":
        modules = _OP_MODULES
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
    return SimpleNamespace(**{op: getattr(importlib.import_module(f"{__name__}.{m}"), op)
                              for op, m in modules.items()})
