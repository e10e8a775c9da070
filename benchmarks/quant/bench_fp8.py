"""FP8 W8A8 GEMM (the model's path: kernels/fp8.fp8_gemm = per-token activation quantization
+ row-wise torch._scaled_mm) vs bf16 F.linear at Llama-3.1-8B shapes (GPU; imports only
kernels/). Per shape and row count it times, each in a CUDA graph over enough weight copies
that none is read from L2:

    bf16        F.linear(x, w) in bf16 (what the unquantized model runs)
    fp8         fp8_gemm(x, ...): quantization + GEMM, what the FP8 model runs
    gemm_only   torch._scaled_mm on already-quantized x (the GEMM's share)
    quant       the Triton per-token quantization alone; quant_torch: the same in torch ops

and checks fp8's output against the float emulation (kernels/fp8_reference) at each shape.
Records (kind fp8_gemm) go to --out/fp8_gemm_<time>.jsonl; a table goes to stdout.

    python benchmarks/quant/bench_fp8.py --out $OUT [--rows 1 16 256]

Without a GPU: a smoke run of the script at tiny fp32 shapes (CPU timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import environment  # noqa: E402
from benchmarks.quant.timing import graph_ms  # noqa: E402
from pagedserve.kernels import fp8  # noqa: E402
from pagedserve.kernels import fp8_reference as ref  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # name: (n, k)
ROWS = [1, 4, 16, 32, 64, 256, 1024, 4096]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    SHAPES, ROWS = {"tiny": (64, 128)}, [1, 16]
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
L2_FLUSH_BYTES = 2 * 60 * 2**20  # twice the H200's L2


def timed(calls) -> float:
    """Median ms per call of one CUDA graph running every call once."""
    if DEV == "cpu":
        start = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - start) * 1e3 / len(calls)
    return graph_ms(calls)


def case(n: int, k: int, rows: int, gen: torch.Generator) -> tuple[dict, float]:
    """ms of each variant, and fp8's relative error against the emulation."""
    copies = max(1, min(32, -(-L2_FLUSH_BYTES // (n * k)))) if DEV == "cuda" else 1
    w = torch.randn(n, k, device=DEV, generator=gen).mul_(0.02).to(DTYPE)
    x = torch.randn(rows, k, device=DEV, generator=gen).to(DTYPE)
    wq, ws = ref.quantize_weight(w)
    ws_row = ws[None, :]
    dense = [w.clone() for _ in range(copies)]
    quant = [wq.clone() for _ in range(copies)]
    xq, sa = fp8.quantize_per_token(x)
    out = fp8.fp8_gemm(x, wq, ws)
    want = ref.fp8_gemm(x.float(), wq, ws)
    err = ((out.float() - want).norm() / want.norm()).item()
    ms = {
        "bf16": timed([lambda d=d: F.linear(x, d) for d in dense]),
        "fp8": timed([lambda q=q: fp8.fp8_gemm(x, q, ws) for q in quant]),
        "gemm_only": timed([lambda q=q: torch._scaled_mm(
            xq, q.t(), scale_a=sa, scale_b=ws_row,
            out_dtype=torch.bfloat16 if DEV == "cuda" else DTYPE) for q in quant]),
        "quant": timed([lambda: fp8.quantize_per_token(x)] * copies),
        "quant_torch": timed([lambda: ref.quantize_per_token(x)] * copies),
    }
    return ms, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    args = ap.parse_args()
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fp8_gemm_{time.strftime('%Y-%m-%dT%H%M%S')}.jsonl"
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows_list = args.rows if DEV == "cuda" else ROWS
    print(f"{'shape':8s} {'n':>6s} {'k':>6s} {'rows':>5s} {'bf16 us':>9s} {'fp8 us':>9s} "
          f"{'speedup':>7s} {'gemm us':>9s} {'quant us':>9s} {'q_torch':>9s} {'rel_err':>8s}")
    for name, (n, k) in SHAPES.items():
        for rows in rows_list:
            ms, err = case(n, k, rows, gen)
            flops = 2 * rows * n * k
            records = [{**env, "kind": "fp8_gemm", "shape": name, "n": n, "k": k, "rows": rows,
                        "impl": impl, "ms": t, "tflops": flops / t / 1e9,
                        "speedup_vs_bf16": ms["bf16"] / t,
                        "rel_err": err if impl == "fp8" else None}
                       for impl, t in ms.items()]
            with path.open("a") as f:  # per case, so a run cut short keeps what it measured
                for r in records:
                    f.write(json.dumps(r) + "\n")
            print(f"{name:8s} {n:6d} {k:6d} {rows:5d} {ms['bf16'] * 1e3:9.1f} "
                  f"{ms['fp8'] * 1e3:9.1f} {ms['bf16'] / ms['fp8']:6.2f}x "
                  f"{ms['gemm_only'] * 1e3:9.1f} {ms['quant'] * 1e3:9.1f} "
                  f"{ms['quant_torch'] * 1e3:9.1f} {err:8.1e}", flush=True)
    print(env["gpu"], "torch", torch.__version__, "->", path)


if __name__ == "__main__":
    main()
