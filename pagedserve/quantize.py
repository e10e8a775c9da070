"""`pagedserve quantize`: make an AWQ or GPTQ 4-bit checkpoint (or plain rounding, written in
GPTQ's format) from an HF directory or a GGUF file, calibrated on a text in data/."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
log = logging.getLogger("pagedserve.quantize")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=["awq", "gptq", "rtn"], required=True,
                   help="awq: activation-aware scales; gptq: error-compensating rounding; "
                        "rtn: plain rounding (written in GPTQ's format)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=128,
                   help="input channels sharing one scale and zero point")
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--calibration", type=Path, default=DATA / "calibration.txt",
                   help="text file whose tokens calibrate awq and gptq")
    p.add_argument("--num-samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    p.add_argument("--sym", action="store_true", help="gptq: symmetric (zero point 8)")
    p.add_argument("--no-act-order", action="store_true", help="gptq: keep channel order")


def quantize(model: str, out: Path, method: str, group_size: int = 128,
             calibration: Path = DATA / "calibration.txt", num_samples: int = 16,
             seq_len: int = 256, sym: bool = False, act_order: bool = True) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.core.models import resolve_model
    from pagedserve.executor.quantization.pipeline import (
        QuantizeOptions,
        calibration_ids,
        quantize_model,
        save_checkpoint,
    )

    src = resolve_model(model)
    opt = QuantizeOptions(method, group_size, sym, act_order, num_samples, seq_len)
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = calibration_ids(tokenizer, calibration.read_text(), num_samples, seq_len)
    start = time.perf_counter()
    quantized = quantize_model(hf, ids, opt)
    save_checkpoint(hf, quantized, src, out, opt)
    log.info("%s g%d: %d linears on %d calibration tokens in %.1f s -> %s", method, group_size,
             len(quantized), ids.numel(), time.perf_counter() - start, out)
    return out


def run(args: argparse.Namespace) -> int:
    quantize(args.model, args.out, args.method, args.group_size, args.calibration,
             args.num_samples, args.seq_len, args.sym, not args.no_act_order)
    return 0
