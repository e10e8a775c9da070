"""Perplexity of the default model on data/perplexity.txt: float vs RTN vs AWQ vs GPTQ (g128),
each checkpoint made by `pagedserve quantize`, and FP8 weights (`--quantization fp8`: e4m3,
per-channel weight scales, per-token activation scales, quantized at load), run through the
executor's own model (torch ops, fp32, CPU; FP8 as its exact emulation), in non-overlapping
windows. Records: kind=perplexity, method, ppl, kv_cache_dtype. `--kv-cache-dtypes auto,fp8`
runs each method over a float cache and an FP8 one (e4m3, the executor's write and read: every
window's attention reads the cache it just wrote).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/quant/perplexity.py [--group-size 128]
    OMP_WAIT_POLICY=PASSIVE python benchmarks/quant/perplexity.py --methods fp \
        --kv-cache-dtypes auto,fp8
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import write_records  # noqa: E402
from pagedserve.core.models import resolve_model  # noqa: E402
from pagedserve.executor.config import ModelConfig  # noqa: E402
from pagedserve.executor.loader import build_model  # noqa: E402
from pagedserve.executor.model import AttentionMetadata  # noqa: E402
from pagedserve.executor.quantization import resolve_quantization  # noqa: E402
from pagedserve.kernels import get_ops  # noqa: E402
from pagedserve.quantize import DATA, quantize  # noqa: E402

BLOCK = 16


KV_DTYPES = {"auto": torch.float32, "fp8": torch.float8_e4m3fn}


def window_nll(model, cfg, ids: list[int], kv_dtype: torch.dtype = torch.float32) -> float:
    """Summed negative log-likelihood of ids[1:] given their prefixes, one prefill."""
    n = len(ids)
    blocks = -(-n // BLOCK)
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.empty(shape, dtype=kv_dtype), torch.empty(shape, dtype=kv_dtype))
          for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    t = torch.tensor(ids)
    logits = model(t, torch.arange(n), kv, meta, torch.arange(n - 1))
    return torch.nn.functional.cross_entropy(logits, t[1:], reduction="sum").item()


def perplexity(model_dir: Path, ids: list[int], window: int, requested: str = "auto",
               kv_cache_dtype: str = "auto") -> float:
    cfg = ModelConfig.from_pretrained(model_dir)
    quant = resolve_quantization(model_dir, requested)
    model = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), window,
                        model_dir, quant=quant)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        nll += window_nll(model, cfg, chunk, KV_DTYPES[kv_cache_dtype])
        count += len(chunk) - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--methods", default="fp,fp8,rtn,awq,gptq")
    ap.add_argument("--text", type=Path, default=DATA / "perplexity.txt")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="comma list of auto (float32 here) and fp8 (e4m3, scales 1.0)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    src = resolve_model(args.model)
    ids = AutoTokenizer.from_pretrained(str(src))(args.text.read_text()).input_ids
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            start = time.perf_counter()
            at_load = method in ("fp", "fp8")
            path = src if at_load else quantize(str(src), Path(tmp) / method, method,
                                                args.group_size)
            quantize_s = time.perf_counter() - start
            for kv in args.kv_cache_dtypes.split(","):
                ppl = perplexity(path, ids, args.window, "fp8" if method == "fp8" else "auto",
                                 kv)
                records.append({"kind": "perplexity", "method": method, "ppl": ppl,
                                "kv_cache_dtype": kv,
                                "group_size": None if at_load else args.group_size,
                                "model": "smollm2-135m-instruct" if args.model == "default"
                                else args.model, "tokens": len(ids), "window": args.window,
                                "text": str(args.text.name), "quantize_s": round(quantize_s, 1)})
                print(f"{method:5s} kv {kv:4s} ppl {ppl:8.3f}  (quantize {quantize_s:5.1f} s)",
                      flush=True)
    print("wrote", write_records("perplexity", records))


if __name__ == "__main__":
    main()
