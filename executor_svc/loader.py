"""Build the model on its device and fill it from safetensors (or with random weights)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedserve.executor.checkpoint import iter_checkpoint
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.model import CausalLM, Ops
from pagedserve.executor.moe import SparseMoe
from pagedserve.executor.quantization import Fp8Linear, QuantConfig, convert_checkpoint
from pagedserve.executor.quantization.config import (
    QuantizationError,
    block_fp8_size,
    dequantized_int,
    is_mxfp4,
    read_quantization_config,
)
from pagedserve.executor.quantization.dequantized import dequantize_int
from pagedserve.executor.quantization.fp8 import dequantize_blocks
from pagedserve.executor.quantization.mxfp4 import check_dequantized_fits, dequantize_mxfp4

log = logging.getLogger("pagedserve.executor")

MXFP4_NATIVE = ("gpt_oss",)  # native families whose MXFP4 experts load dequantized
RANDOM_SCALE = 0.02 / 4.6  # random 4-bit weights spread like the N(0, 0.02) float ones


def build_model(
    cfg: ModelConfig,
    ops: Ops,
    dtype: torch.dtype,
    device: torch.device,
    max_pos: int,
    weights_dir: Path | None,
    seed: int = 0,
    quant: QuantConfig | None = None,
) -> CausalLM:
    """Load from `weights_dir`, or random N(0, 0.02) weights when it is None (benchmarks).
    With `quant`, decoder linears are 4-bit or FP8 (executor_svc/quantization); random 4-bit
    weights are uniform nibbles around zero point 8 with scales that give them about the same
    spread, random FP8 ones N(0, 0.02) quantized per channel."""
    qc = read_quantization_config(weights_dir) if weights_dir is not None else None
    if cfg.impl == "transformers":
        from pagedserve.executor.hf_fallback import TransformersLM

        if quant is not None or block_fp8_size(qc) or dequantized_int(qc):
            raise QuantizationError(f"{cfg.model_type} runs through the transformers fallback, "
                                    f"which serves unquantized and MXFP4 checkpoints only")
        return TransformersLM.build(cfg, ops, dtype, device, weights_dir, seed,
                                    dequantize_mxfp4=is_mxfp4(qc))
    if is_mxfp4(qc):
        if cfg.model_type not in MXFP4_NATIVE:
            raise QuantizationError(f"{cfg.model_type}: MXFP4 checkpoints are served through "
                                    f"the transformers fallback (--model-impl auto or "
                                    f"transformers)")
        served = torch.float8_e4m3fn if quant is not None else dtype  # (FP8: about)
        check_dequantized_fits(weights_dir, served, device, cfg.tp_size)  # one line, no OOM
    with torch.device("meta"):
        model = CausalLM(cfg, ops, max_pos, quant)
    _cast(model, dtype)  # on meta: the device holds the weights in their dtype only, never in
    model = model.to_empty(device=device)  # float32 first (Mixtral-8x7B: 174 GiB, not 87)
    model.set_rope(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if weights_dir is None:
        # drawn on the model's device: an 8B model's 8e9 draws take minutes on a CPU
        gen = torch.Generator(device=device).manual_seed(seed)
        fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)
               or isinstance(m, SparseMoe) and m.fp8]
        for m in fp8:
            m.fill_random(gen)
        done = {id(p) for m in fp8 for p in m.parameters()}
        for name, p in model.named_parameters():
            if id(p) in done:
                continue
            if "norm" in name:
                p.data.fill_(1.0)
            elif name.endswith(".qweight"):  # 8 uniform nibbles per word
                p.data.random_(-(2**31), 2**31, generator=gen)
            elif name.endswith(".zeros"):
                p.data.fill_(8.0)
            elif name.endswith(".scales"):  # std of (q - 8) for uniform q in 0..15 is 4.6
                p.data.uniform_(0.9 * RANDOM_SCALE, 1.1 * RANDOM_SCALE, generator=gen)
            elif name.endswith(".perm"):
                p.data.copy_(torch.arange(p.numel(), device=device))
            else:
                p.data.normal_(0.0, 0.02, generator=gen)
    else:
        weights = iter_checkpoint(weights_dir)
        block, ints = block_fp8_size(qc), dequantized_int(qc)
        then = ", then quantized to FP8 per output channel" if quant else ""
        if block is not None:  # a block-wise FP8 checkpoint: float from here on
            log.info("block-wise FP8 weights (blocks of %d x %d) dequantized at load%s",
                     *block, then)
            weights = dequantize_blocks(weights, block)
        if is_mxfp4(qc):  # gpt-oss's experts: float from here on
            log.info("MXFP4 experts dequantized to %s at load%s", str(dtype)[6:], then)
            weights = dequantize_mxfp4(weights, dtype, device)
        if ints is not None:  # integers the kernels do not take: float from here on
            log.info("%s int%d weights dequantized at load%s", ints.layout, ints.bits, then)
            weights = dequantize_int(weights, ints)
        model.load_weights(convert_checkpoint(weights, quant) if quant else weights)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.finish_loading()
    return model.eval()


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """model.to(dtype), except the parameters a module keeps in their own dtype (FP8 codes and
    their float32 scales: Module.to would cast float8 too)."""
    for m in model.modules():
        fixed = getattr(m, "fixed_dtypes", ())
        for name, p in m.named_parameters(recurse=False):
            if name not in fixed and p.is_floating_point():
                p.data = p.data.to(dtype)
