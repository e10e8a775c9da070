"""kernels/gemv.py against cuBLAS (F.linear) at a decode step's few rows, same weights.

    python3 benchmarks/kernels/bench_gemv.py                # GPU: bf16, 1, 2 and 4 rows
    python3 benchmarks/kernels/bench_gemv.py --smoke        # CPU interpreter, tiny shapes
    python3 benchmarks/kernels/bench_gemv.py --sweep        # GPU: gemv's tiles at one row

Shapes: Qwen3-30B-A3B's q/k/v (2048 -> 5120), o_proj (4096 -> 2048) and router (2048 -> 128);
Llama-3.1-8B's q/k/v (4096 -> 6144), gate_up (4096 -> 28672) and down (14336 -> 4096). Each
timing is a CUDA-graph replay that cycles through copies of the weight until it reads 4 L2
caches' worth (a model's step reads each weight once, from HBM). Records (family `kernels`,
kind `gemv`): ms and TB/s of the weight bytes, impl `cublas` or `triton` (gemv), and gemv's
relative error against F.linear in float32.

--sweep: gemv's tiles (BLOCK_N x BLOCK_K, num_warps) at --rows (default 1) on each shape, the
same cold-weight replays: records kind `gemv_sweep` (results keep each shape's fastest; the
grid goes to archive/), the default tile's time printed beside the best. At cd268e7 o_proj
read its 16.8 MB at 1.7 TB/s where q/k/v read 21 MB at 2.4 (docs/performance.md).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.timing import interpret, median_ms  # noqa: E402

SHAPES = {"qwen3_30b_a3b.qkv": (5120, 2048), "qwen3_30b_a3b.o": (2048, 4096),
          "qwen3_30b_a3b.router": (128, 2048), "llama3.1_8b.qkv": (6144, 4096),
          "llama3.1_8b.gate_up": (28672, 4096), "llama3.1_8b.down": (4096, 14336)}
SMOKE_SHAPES = {"tiny": (48, 80)}
COLD_L2 = 4


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    p.add_argument("--rows", nargs="*", type=int, default=None,
                   help="rows of x (default 1 2 4; --sweep: 1)")
    p.add_argument("--sweep", action="store_true", help="gemv's tiles at each shape")
    return p.parse_args()


ARGS = parse()
ARGS.rows = ARGS.rows or ([1] if ARGS.sweep else [1, 2, 4])
if ARGS.smoke:
    interpret("bench_gemv_")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import write_records  # noqa: E402
from pagedserve.executor.layers import GEMV_MAX_BYTES  # noqa: E402
from pagedserve.kernels.gemv import dense_tiles, gemv  # noqa: E402

DEV = torch.device("cpu" if ARGS.smoke else "cuda")
DT = torch.float32 if ARGS.smoke else torch.bfloat16


def copies_for(nbytes: int) -> int:
    if DEV.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    return max(1, min(-(-COLD_L2 * l2 // nbytes), 64))


def sweep_grid(n: int, k: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps): BLOCK_K 256 to the padded K, BLOCK_N 1 to 16, at most
    16,384 weights a program step; 4 or 8 warps (the smoke run: two tiles)."""
    if ARGS.smoke:
        return [(8, 16, 1), (*dense_tiles(n, k), 4)]
    kp = triton.next_power_of_2(k)
    return [(bn, bk, w) for bk in (256, 512, 1024, 2048, 4096) if bk <= kp
            for bn in (1, 2, 4, 8, 16) if bn * bk <= 16384 and bn <= n
            for w in (4, 8)]


def sweep_main() -> None:
    torch.manual_seed(0)
    records = []
    for name, (n, k) in (SMOKE_SHAPES if ARGS.smoke else SHAPES).items():
        nbytes = n * k * torch.finfo(DT).bits // 8
        if not ARGS.smoke and nbytes > GEMV_MAX_BYTES:
            continue  # past the executor's cap (PAGEDSERVE_DENSE_GEMV_MAX_MIB): cuBLAS's
        ws = [torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5
              for _ in range(copies_for(nbytes))]
        for m in ARGS.rows:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            want = F.linear(x.float(), ws[0].float())
            timed = {}
            for bn, bk, w in sweep_grid(n, k):
                got = gemv(x, ws[0], block=(bn, bk), num_warps=w).float()
                ok = torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
                run = functools.partial(
                    lambda x, ws, b, w: [gemv(x, wt, block=b, num_warps=w) for wt in ws],
                    x, ws, (bn, bk), w)
                ms = median_ms(run, not ARGS.smoke, ARGS.smoke) / len(ws)
                timed[(bn, bk, w)] = ms
                records.append({"kind": "gemv_sweep", "shape": name, "rows": m, "n": n, "k": k,
                                "impl": "sweep" if ok else "sweep_wrong",
                                "config": {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w},
                                "dtype": str(DT).removeprefix("torch."), "ms": ms,
                                "tbps": nbytes / ms / 1e9, "weight_copies": len(ws),
                                "smoke": ARGS.smoke})
            best = min(timed, key=timed.get)
            default = (*dense_tiles(n, k), 4)
            print(f"{name:22s} M={m} best {best} {timed[best] * 1e3:7.2f} us "
                  f"{nbytes / timed[best] / 1e9:5.2f} TB/s; default {default} "
                  f"{timed.get(default, float('nan')) * 1e3:7.2f} us", flush=True)
    print("wrote", write_records("kernels", records))


def main() -> None:
    if ARGS.sweep:
        return sweep_main()
    torch.manual_seed(0)
    records = []
    for name, (n, k) in (SMOKE_SHAPES if ARGS.smoke else SHAPES).items():
        nbytes = n * k * torch.finfo(DT).bits // 8
        ws = [torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5
              for _ in range(copies_for(nbytes))]
        for m in ARGS.rows:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            err = ((gemv(x, ws[0]).float() - F.linear(x.float(), ws[0].float())).norm()
                   / F.linear(x.float(), ws[0].float()).norm()).item()
            for impl, fn in (("cublas", F.linear), ("triton", gemv)):
                run = functools.partial(lambda fn, x, ws: [fn(x, w) for w in ws], fn, x, ws)
                ms = median_ms(run, not ARGS.smoke, ARGS.smoke) / len(ws)
                records.append({"kind": "gemv", "shape": name, "rows": m, "n": n, "k": k,
                                "impl": impl, "dtype": str(DT).removeprefix("torch."),
                                "ms": ms, "tbps": nbytes / ms / 1e9, "weight_copies": len(ws),
                                "rel_err_vs_fp32": err if impl == "triton" else 0.0,
                                "smoke": ARGS.smoke})
                print(f"{name:22s} M={m} {impl:6s} {ms * 1e3:8.2f} us "
                      f"{nbytes / ms / 1e9:5.2f} TB/s" + (f" err {err:.1e}" if impl == "triton"
                                                           else ""), flush=True)
    print("wrote", write_records("kernels", records))


if __name__ == "__main__":
    main()
