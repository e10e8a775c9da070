"""Which quantized format a checkpoint is in, from config.json's `quantization_config` (as
AutoAWQ, AutoGPTQ, transformers and llm-compressor write it), and whether it can be served:
refused at start, with why. FP8's own fields are parsed in executor_svc/quantization/fp8.
MXFP4 (gpt-oss's experts) is dequantized at load (quantization/mxfp4.py, or the transformers
fallback's own), and served in float or quantized again to FP8."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("auto", "none", "awq", "gptq", "fp8", "mxfp4")
GROUP_SIZES = (32, 64, 128)


class QuantizationError(ValueError):
    """A checkpoint or a --quantization value that cannot be served."""


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: str  # "awq", "gptq" or "fp8"
    group_size: int  # 0 for fp8 (per-channel scales)
    act_order: bool = False  # GPTQ desc_act: input channels permuted by g_idx
    sym: bool = False  # informational: symmetric checkpoints store zero 8 like any other
    zero_offset: int = 0  # added to stored zeros: 1 for GPTQ's v1 format (stores zero - 1)
    fp8_serialized: bool = False  # fp8: the checkpoint holds e4m3 weights (else quantize at load)
    static_activations: bool = False  # fp8: the checkpoint's input_scale, not per-token scales
    packing: str = ""  # gptq: "pack-quantized" for compressed-tensors' int4 tensor names

    def describe(self) -> str:
        if self.method != "fp8":
            source = f" (compressed-tensors {self.packing})" if self.packing else ""
            return f"{self.method} 4-bit, group {self.group_size}{source}"
        source = "checkpoint" if self.fp8_serialized else "quantized at load"
        acts = "static" if self.static_activations else "per-token"
        return f"fp8 e4m3 ({source}), {acts} activation scales"


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
    found = _method_of(qc)
    ints = dequantized_int(qc)
    if ints is not None:  # dequantized at load (loader.py): served in float, or quantized
        if requested in ("auto", "fp8"):  # again per output channel with --quantization fp8
            return QuantConfig("fp8", 0) if requested == "fp8" else None
        raise QuantizationError(f"--quantization {requested}: {model_dir} holds "
                                f"{ints.layout} int{ints.bits} weights, served "
                                "dequantized at load (auto) or as FP8 (fp8)")
    if requested == "none":
        if found:
            raise QuantizationError(f"{model_dir} is a {found} checkpoint; serve it with "
                                    f"--quantization {found} or auto")
        return None
    if qc is None:
        if requested == "fp8":  # quantized at load (or random FP8 weights)
            return QuantConfig("fp8", 0)
        if random and requested in ("awq", "gptq"):
            return QuantConfig(requested, RANDOM_GROUP_SIZE)
        if requested == "auto":
            return None
        if requested == "mxfp4":
            raise QuantizationError("--quantization mxfp4 serves MXFP4 checkpoints (gpt-oss), "
                                    f"and {model_dir}/config.json has no quantization_config")
        raise QuantizationError(f"--quantization {requested}: {model_dir}/config.json has no "
                                "quantization_config")
    if found == "mxfp4" and requested in ("auto", "mxfp4", "fp8"):  # dequantized at load
        # (loader.py): served in float, or quantized again per output channel with fp8 (the
        # native gpt-oss only: the transformers fallback serves no quantized linear)
        return QuantConfig("fp8", 0) if requested == "fp8" else None
    if requested != "auto" and requested != found:
        raise QuantizationError(f"--quantization {requested}, but the checkpoint's "
                                f"quantization_config says {found!r}")
    if found == "fp8":
        method = str(qc.get("quant_method")).lower()
        if method == "fp8" and block_fp8_size(qc):  # dequantized at load (loader.py): served
            # in float, or quantized again per output channel with --quantization fp8
            return QuantConfig("fp8", 0) if requested == "fp8" else None
        return parse_fp8(qc) if method == "fp8" else parse_compressed_tensors(qc)
    if found not in ("awq", "gptq"):
        raise QuantizationError(f"quant_method {found!r} is not supported (awq, gptq, fp8, "
                                "compressed-tensors float8 and int4, mxfp4)")
    if str(qc.get("quant_method")).lower() == "compressed-tensors":
        return parse_compressed_int4(qc)
    return _parse(found, qc)


def _method_of(qc: dict[str, Any] | None) -> str | None:
    """The --quantization value that serves `qc`: compressed-tensors float8 is fp8."""
    if not qc:
        return None
    found = str(qc.get("quant_method", "")).lower()
    if found == "compressed-tensors":
        fmt = _ct_format(qc)
        if fmt in ("float-quantized", "naive-quantized"):
            return "fp8"
        if fmt == "pack-quantized":  # int4 weights in GPTQ's layout under other names
            return "gptq"
    return found


def _ct_format(qc: dict[str, Any]) -> str | None:
    """compressed-tensors' format: the top-level one, or its config groups' one where they
    agree (a mixed-precision checkpoint names each group's)."""
    fmt = qc.get("format")
    if fmt in (None, "mixed-precision"):
        found = {g.get("format") for g in (qc.get("config_groups") or {}).values()}
        return found.pop() if len(found) == 1 else fmt
    return fmt


def parse_compressed_int4(qc: dict[str, Any]) -> QuantConfig:
    """compressed-tensors' pack-quantized int4 weights with float activations (llm-compressor's
    W4A16 and W4A16_ASYM schemes): weight_packed [N, K/8] int32 (eight values a word along K,
    each + 8), weight_scale [N, K/G], weight_zero_point [N/8, K/G] (asymmetric only, packed
    along N), weight_g_idx [K] (activation order "group"); served as GPTQ."""
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise QuantizationError("compressed-tensors: config_groups is empty")
    schemes = {json.dumps(g.get("weights") or {}, sort_keys=True) for g in groups}
    if len(schemes) > 1:
        raise QuantizationError("compressed-tensors: config_groups with different weight "
                                "schemes are not supported (one int4 scheme for every linear)")
    w = groups[0].get("weights") or {}
    if (w.get("type"), w.get("num_bits")) != ("int", 4):
        raise QuantizationError(f"compressed-tensors: pack-quantized weights type "
                                f"{w.get('type')!r} num_bits {w.get('num_bits')} are not "
                                "supported (int, 4)")
    acts = [g["input_activations"] for g in groups if g.get("input_activations")]
    if acts:
        raise QuantizationError(f"compressed-tensors: quantized input_activations "
                                f"({acts[0].get('type')} {acts[0].get('num_bits')}-bit) with "
                                "int4 weights are not supported (W4A16: float activations)")
    if w.get("strategy") != "group" or w.get("group_size") not in GROUP_SIZES:
        raise QuantizationError(
            f"compressed-tensors: int4 weight strategy {w.get('strategy')!r} group_size "
            f"{w.get('group_size')} is not supported (group, group_size "
            f"{', '.join(map(str, GROUP_SIZES))}; per-channel is not)")
    if w.get("dynamic"):
        raise QuantizationError("compressed-tensors: dynamic int4 weights are not supported")
    order = w.get("actorder")
    if order not in (None, False, True, "group", "weight"):
        raise QuantizationError(f"compressed-tensors: actorder {order!r} is not supported "
                                "(group, weight or none)")
    _check_ignored("compressed-tensors", qc.get("ignore") or [])
    return QuantConfig("gptq", int(w["group_size"]), act_order=order in (True, "group"),
                       sym=bool(w.get("symmetric", True)), packing="pack-quantized")


def _parse(method: str, qc: dict[str, Any]) -> QuantConfig:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantizationError(f"{method}: only 4-bit weights are supported, got bits={bits}")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise QuantizationError(f"{method}: group_size {group} is not supported "
                                f"({', '.join(map(str, GROUP_SIZES))}; per-channel -1 is not)")
    skipped = [m for m in qc.get("modules_to_not_convert") or [] if not _stays_float(m)]
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


# ------------------------------------------- dequantized at load (dequantized.py)
@dataclass(frozen=True, slots=True)
class IntWeights:
    """A checkpoint's integer weights served dequantized at load (quantization/dequantized.py):
    config.json's one weights scheme."""

    bits: int
    group_size: int  # 0 for one scale per channel or per tensor
    sym: bool
    act_order: bool  # a g_idx is there
    layout: str = "compressed-tensors"  # or "gptq"
    zero_offset: int = 0  # gptq: added to stored zeros (1 for checkpoint_format gptq)


def dequantized_int(qc: dict[str, Any] | None) -> IntWeights | None:
    """Integer weights the 4-bit kernels do not take, which the loader dequantizes to float:
    compressed-tensors' 8-bit ones (W8A8, W8A16) and 2/4-bit ones with a scale per channel or
    tensor or with quantized activations; GPTQ's 8-bit ones (Qwen's GPTQ-Int8) and 2/4-bit
    ones with a group size the kernels do not take (-1: per channel); bitsandbytes' 4-bit (NF4,
    FP4) and 8-bit ones. None for any other checkpoint; raises what it cannot read. Modules left
    in float (ignore lists) need no check: their weights pass through dequantization."""
    method = str((qc or {}).get("quant_method", "")).lower()
    if method == "gptq":
        return _dequantized_gptq(qc)
    if method == "bitsandbytes":
        four = bool(qc.get("load_in_4bit") or qc.get("_load_in_4bit"))
        if not four and not (qc.get("load_in_8bit") or qc.get("_load_in_8bit")):
            raise QuantizationError("bitsandbytes: neither load_in_4bit nor load_in_8bit")
        storage = qc.get("bnb_4bit_quant_storage") or "uint8"
        if four and storage != "uint8":
            raise QuantizationError(f"bitsandbytes: bnb_4bit_quant_storage {storage!r} is "
                                    "not supported (uint8)")
        return IntWeights(4 if four else 8, 0, True, False, layout="bitsandbytes")
    if method != "compressed-tensors":
        return None
    groups = list((qc.get("config_groups") or {}).values())
    ws = [g.get("weights") or {} for g in groups]
    if _ct_format(qc) not in ("int-quantized", "naive-quantized", "pack-quantized") or not ws \
            or any(w.get("type") != "int" for w in ws):
        return None
    if _ct_format(qc) == "pack-quantized":
        try:
            parse_compressed_int4(qc)
            return None  # the 4-bit kernels serve it
        except QuantizationError:
            pass
    if len({json.dumps(w, sort_keys=True) for w in ws}) > 1:
        raise QuantizationError("compressed-tensors: config_groups with different weight "
                                "schemes are not supported")
    w = ws[0]
    bits, strategy, group = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if bits not in (2, 4, 8) or (bits != 8 and _ct_format(qc) != "pack-quantized"):
        raise QuantizationError(f"compressed-tensors: int weights of {bits} bits are not "
                                "supported (8, or 2 and 4 packed)")
    if strategy not in ("tensor", "channel", "group") or (
            strategy == "group" and not (isinstance(group, int) and group > 0)):
        raise QuantizationError(f"compressed-tensors: int weight strategy {strategy!r} "
                                f"group_size {group} is not supported (tensor, channel, group)")
    if w.get("dynamic"):
        raise QuantizationError("compressed-tensors: dynamic int weights are not supported")
    order = w.get("actorder")
    if order not in (None, False, True, "group", "weight"):
        raise QuantizationError(f"compressed-tensors: actorder {order!r} is not supported")
    return IntWeights(bits, group if strategy == "group" else 0, bool(w.get("symmetric", True)),
                      order in (True, "group") and strategy == "group")


def _dequantized_gptq(qc: dict[str, Any]) -> IntWeights | None:
    bits, group = qc.get("bits"), qc.get("group_size")
    floats = [m for m in qc.get("modules_to_not_convert") or [] if not _stays_float(m)]
    if bits == 4 and group in GROUP_SIZES and not floats:
        return None  # the 4-bit kernels serve it (every decoder linear 4-bit)
    if bits not in (2, 4, 8):
        raise QuantizationError(f"gptq: {bits}-bit weights are not supported (4; 2 and 8 "
                                "dequantized at load)")
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise QuantizationError(f"gptq: group_size {group} is not supported")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq: checkpoint_format {fmt!r} is not supported "
                                "(gptq, gptq_v2)")
    return IntWeights(bits, max(group, 0), bool(qc.get("sym", True)),
                      bool(qc.get("desc_act", False)) and group > 0, layout="gptq",
                      zero_offset=1 if fmt == "gptq" else 0)


def is_mxfp4(qc: dict[str, Any] | None) -> bool:
    """An MXFP4 checkpoint (gpt-oss's releases): the experts' weights as `*_blocks` (two FP4
    e2m1 values a byte, 32 a block) and `*_scales` (one power-of-two exponent a block)."""
    return bool(qc) and str(qc.get("quant_method", "")).lower() == "mxfp4"


# ---------------------------------------------------------------- FP8 (W8A8 e4m3)
def block_fp8_size(qc: dict[str, Any] | None) -> tuple[int, int] | None:
    """The [rows, columns] of a block-wise FP8 checkpoint's weight scales (quant_method fp8
    with weight_block_size, as Qwen3's and DeepSeek's FP8 releases: weight e4m3 [N, K] and
    weight_scale_inv float32 [ceil(N / rows), ceil(K / columns)]), else None."""
    if not qc or str(qc.get("quant_method", "")).lower() != "fp8":
        return None
    block = qc.get("weight_block_size")
    if not block:
        return None
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"fp8: weight_block_size {block!r} is not two positive ints")
    _check_e4m3(qc)
    return int(block[0]), int(block[1])


def _check_e4m3(qc: dict[str, Any]) -> None:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise QuantizationError(f"fp8: fmt {fmt!r} is not supported (e4m3)")


def parse_fp8(qc: dict[str, Any]) -> QuantConfig:
    """config.json's quantization_config with quant_method fp8 (scales per tensor or per
    output channel; block-wise scales: block_fp8_size)."""
    _check_e4m3(qc)
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"fp8: activation_scheme {scheme!r} is not supported "
                                "(dynamic, static)")
    _check_ignored("fp8", qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    return QuantConfig("fp8", 0, fp8_serialized=True, static_activations=scheme == "static")


def parse_compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    """compressed-tensors' float8 W8A8 (llm-compressor's FP8 and FP8_DYNAMIC schemes)."""
    fmt = _ct_format(qc)
    if fmt not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(f"compressed-tensors: format {fmt!r} is not supported "
                                "(float-quantized or naive-quantized float8)")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise QuantizationError("compressed-tensors: config_groups is empty")
    statics = {_ct_group(g) for g in groups}
    if len(statics) > 1:
        raise QuantizationError("compressed-tensors: config_groups mix static and dynamic "
                                "activations")
    _check_ignored("compressed-tensors", qc.get("ignore") or [])
    return QuantConfig("fp8", 0, fp8_serialized=True, static_activations=statics.pop())


def _ct_group(g: dict[str, Any]) -> bool:
    """One config group -> whether its activations are static; refuses what is not FP8 W8A8."""
    w, a = g.get("weights") or {}, g.get("input_activations")
    if (w.get("type"), w.get("num_bits")) != ("float", 8):
        raise QuantizationError(f"compressed-tensors: weights type {w.get('type')!r} "
                                f"num_bits {w.get('num_bits')} are not supported (float, 8)")
    if w.get("strategy") not in ("tensor", "channel"):
        raise QuantizationError(f"compressed-tensors: weight strategy {w.get('strategy')!r} "
                                "is not supported (tensor, channel)")
    if w.get("symmetric") is False:
        raise QuantizationError("compressed-tensors: asymmetric float8 weights are not "
                                "supported")
    if not a:
        raise QuantizationError("compressed-tensors: weight-only float8 (no "
                                "input_activations) is not supported; W8A8 is")
    if (a.get("type"), a.get("num_bits")) != ("float", 8):
        raise QuantizationError(f"compressed-tensors: input_activations type {a.get('type')!r} "
                                f"num_bits {a.get('num_bits')} are not supported (float, 8)")
    if a.get("dynamic"):  # token or tensor: both served per token, the finer of the two
        return False
    if a.get("strategy") != "tensor":
        raise QuantizationError(f"compressed-tensors: static input_activations strategy "
                                f"{a.get('strategy')!r} is not supported (tensor)")
    return True


_IGNORABLE = ("lm_head", "gate", "shared_expert_gate")  # float here anyway


def _stays_float(module: str) -> bool:
    """A module a quantized checkpoint may leave in float (modules_to_not_convert, ignore;
    names or compressed-tensors' "re:" patterns): the LM head, and the routers of
    mixture-of-experts layers, which are float here anyway."""
    last = module.removeprefix("re:").removesuffix("$").rpartition(".")[2]
    return last.endswith(_IGNORABLE)  # "re:.*lm_head" included


def _check_ignored(method: str, ignored: list[str]) -> None:
    kept = [m for m in ignored if not _stays_float(m)]
    if kept:
        raise QuantizationError(f"{method}: float layers {kept[:4]} among the quantized ones "
                                "are not supported (every decoder linear must be quantized)")
