"""Which 4-bit format a checkpoint is in, from config.json's `quantization_config` (as AutoAWQ,
AutoGPTQ and transformers write it), and whether it can be served: refused at start, with why."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("auto", "none", "awq", "gptq")
GROUP_SIZES = (32, 64, 128)


class QuantizationError(ValueError):
    """A checkpoint or a --quantization value that cannot be served."""


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: str  # "awq" or "gptq"
    group_size: int
    act_order: bool = False  # GPTQ desc_act: input channels permuted by g_idx
    sym: bool = False  # informational: symmetric checkpoints store zero 8 like any other
    zero_offset: int = 0  # added to stored zeros: 1 for GPTQ's v1 format (stores zero - 1)


def read_quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("quantization_config")


RANDOM_GROUP_SIZE = 128


def resolve_quantization(model_dir: str | Path, requested: str = "auto",
                         random: bool = False) -> QuantConfig | None:
    """None for a float checkpoint; raises QuantizationError for what cannot be served.
    random: the weights will be drawn, not loaded (benchmarks), so `--quantization awq|gptq`
    of a float config means random 4-bit weights at group size 128."""
    if requested not in METHODS:
        raise QuantizationError(f"quantization must be one of {', '.join(METHODS)}, "
                                f"got {requested!r}")
    qc = read_quantization_config(model_dir)
    found = str(qc.get("quant_method", "")).lower() if qc else None
    if requested == "none":
        if found:
            raise QuantizationError(f"{model_dir} is a {found} checkpoint; serve it with "
                                    f"--quantization {found} or auto")
        return None
    if qc is None:
        if random and requested in ("awq", "gptq"):
            return QuantConfig(requested, RANDOM_GROUP_SIZE)
        if requested == "auto":
            return None
        raise QuantizationError(f"--quantization {requested}: {model_dir}/config.json has no "
                                "quantization_config")
    if requested != "auto" and requested != found:
        raise QuantizationError(f"--quantization {requested}, but the checkpoint's "
                                f"quantization_config says {found!r}")
    if found not in ("awq", "gptq"):
        raise QuantizationError(f"quant_method {found!r} is not supported (awq, gptq)")
    return _parse(found, qc)


def _parse(method: str, qc: dict[str, Any]) -> QuantConfig:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantizationError(f"{method}: only 4-bit weights are supported, got bits={bits}")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise QuantizationError(f"{method}: group_size {group} is not supported "
                                f"({', '.join(map(str, GROUP_SIZES))}; per-channel -1 is not)")
    skipped = [m for m in qc.get("modules_to_not_convert") or [] if m != "lm_head"]
    if skipped:
        raise QuantizationError(f"{method}: modules_to_not_convert {skipped} is not supported "
                                "(every decoder linear must be quantized)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"awq: version {version!r} is not supported (gemm packing)")
        if not qc.get("zero_point", True):
            raise QuantizationError("awq: zero_point=false is not supported")
        return QuantConfig("awq", group)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq: checkpoint_format {fmt!r} is not supported "
                                "(gptq, gptq_v2)")
    return QuantConfig("gptq", group, act_order=bool(qc.get("desc_act", False)),
                       sym=bool(qc.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0)
