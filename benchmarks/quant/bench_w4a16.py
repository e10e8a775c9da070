"""W4A16 GEMM vs bf16 torch.matmul at Llama-3.1-8B shapes (GPU only; imports only kernels/).

For each shape and row count: checks every kernel config it times against a dequantize+matmul
reference in fp32 (outputs poisoned with NaN first), times the heuristic's choice (what the
model uses) and, with --sweep, a grid of configs, and bf16 torch.matmul in the same run.
Records (kind w4a16_gemm) go to --out as JSONL; a table goes to stdout.

    python benchmarks/quant/bench_w4a16.py --out $OUT [--sweep | --planes | --gluon]
        [--rows 1 16 32]

--sweep: the decode kernel's column tile and program target (rows <= 16) and the split-K
tiled kernel's tiles (rows >= 16); --planes: the plane-major tiled configs; --gluon: the Gluon
kernel's (sm_90). At 1 row each shape also gets a read floor: the time to stream its packed
weight once, which no W4A16 kernel can beat.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import environment  # noqa: E402
from benchmarks.quant.timing import graph_ms  # noqa: E402
from pagedserve.kernels import w4a16  # noqa: E402
from pagedserve.kernels.w4a16_decode import (  # noqa: E402
    DECODE_MAX_ROWS,
    DecodeConfig,
    w4a16_decode,
)
from pagedserve.kernels.w4a16_gluon import GluonConfig, w4a16_gluon  # noqa: E402
from pagedserve.kernels.w4a16_prefill import PrefillConfig, w4a16_prefill  # noqa: E402
from pagedserve.kernels.w4a16_reference import dequantize, pack_int4  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]  # (n, k): qkv/o, gate, down
ROWS = [1, 4, 16, 32, 64, 128, 256]
GROUP = 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # smoke run of the script itself under TRITON_INTERPRET=1, tiny shapes
    SHAPES, ROWS = [(64, 256)], [1, 4, 17, 128]  # the interpreter has no bf16
    from pagedserve.kernels._interpreter import fix_interpreter_index

    fix_interpreter_index()
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


def make_weight(n, k, dtype, gen_seed):
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    q = torch.randint(0, 16, (k, n), device=DEV, generator=g, dtype=torch.int32)
    groups = -(-k // GROUP)
    s = (torch.rand(groups, n, device=DEV, generator=g) * 0.02 + 0.001).to(dtype)
    z = torch.randint(0, 16, (groups, n), device=DEV, generator=g).to(dtype)
    return pack_int4(q), s, z


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def decode_grid(rows):
    """Column tile x program target (the split-K follows from it) around the defaults."""
    return [DecodeConfig(block_n=bn, target_programs=target)
            for bn in (32, 64, 128, 256) for target in (264, 528, 1056)]


# The reshaped-tile (group < 128) kernel's tiles, split K ways: one program per output tile
# takes the same time per K tile whatever its rows, so few tiles make a slow GEMM.
TILED_GRID = [
    PrefillConfig(bm, bn, bk, warps, stages, split_k=split)
    for bm, bn, bk, warps, stages in [(128, 128, 128, 8, 3), (32, 128, 64, 4, 4),
                                      (64, 128, 64, 4, 4), (128, 128, 64, 8, 4),
                                      (256, 128, 64, 8, 3)]
    for split in (2, 4, 8, 16)
]


def planes_grid(rows):
    """Plane-major x, one dot per nibble plane (BLOCK_K 128). sass_w4a16.py shows no
    shared-memory round trip of the weight when BLOCK_N = 16 x warps (one 16-row slab of
    W^T per warp). The defaults up to 128 rows came from commit abd1e5d's grid; this one looks
    past them at 128 and 256: two stages (two programs per SM, one dequantizing while the
    other multiplies) and 16 warps with BLOCK_N 256 (each program re-reads x for half as many
    weight columns)."""
    if rows < 128:
        return []
    shapes = [(128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 8, 2), (64, 256, 16, 3),
              (64, 256, 16, 4), (128, 256, 16, 2)]
    if rows > 128:
        shapes += [(256, 128, 8, 2), (256, 128, 8, 3)]
    return [PrefillConfig(bm, bn, 128, warps, stages, split_k=split, planes=True)
            for bm, bn, warps, stages in shapes for split in (1, 2)]


def gluon_grid(rows):
    """The Gluon kernel (kernels/w4a16_gluon.py) around the rows' M tile: 8 warps (BLOCK_N 128),
    4 warps at the small tiles."""
    if rows <= 32:
        shapes = [(32, 8, 3), (32, 4, 4)]
    elif rows <= 64:
        shapes = [(64, 8, 3), (64, 4, 4), (32, 8, 3)]
    elif rows <= 128:
        shapes = [(128, 8, 3), (64, 8, 3)]
    else:
        shapes = [(256, 8, 2), (128, 8, 3)]
    splits = (2, 4, 8) if rows <= 64 else (1, 2, 4)
    return [GluonConfig(bm, warps, stages, split)
            for bm, warps, stages in shapes for split in splits]


@triton.jit
def _stream_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Reads n int32 (each program a contiguous chunk), writes one word per program: the time
    any kernel needs to read the packed weight once, launch included."""
    start = tl.program_id(0) * BLOCK * 16
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(16):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(dst_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_floor(quant):
    """Median ms to stream each copy's qweight once (the int4 GEMV's memory floor)."""
    if DEV != "cuda":
        return float("nan")
    n = quant[0][0].numel()
    block = 1024
    grid = (triton.cdiv(n, block * 16),)
    dst = torch.empty(grid[0], dtype=torch.int32, device=DEV)
    return bench_graph([lambda q=q: _stream_kernel[grid](q[0], dst, n, BLOCK=block, num_warps=4)
                        for q in quant])


L2_FLUSH_BYTES = 240e6  # rotate over weight copies totalling 4x the 60 MB L2


def bench_eager(fn):
    if DEV == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def bench_graph(calls):
    """Median ms per call of one CUDA graph that runs every call once (each on its own weight
    copy, so none is read from L2): kernel time without Python launch overhead."""
    if DEV == "cpu":
        return bench_eager(calls[0])
    return graph_ms(calls)


def copies_for(nbytes):
    return max(1, int(-(-L2_FLUSH_BYTES // nbytes))) if DEV == "cuda" else 1


def sweep_configs(sweep, rows):
    """(config, launcher) pairs of a sweep at `rows`."""
    if sweep == "gluon":
        return [(c, w4a16_gluon) for c in gluon_grid(rows)] if rows > DECODE_MAX_ROWS else []
    if sweep == "planes":
        return [(c, w4a16_prefill) for c in planes_grid(rows)] if rows > DECODE_MAX_ROWS else []
    configs = [(c, w4a16_decode) for c in decode_grid(rows)] if rows <= DECODE_MAX_ROWS else []
    if rows >= 16:
        configs += [(c, w4a16_prefill) for c in TILED_GRID]
    return configs


def run_case(n, k, rows, dtype, sweep, seed):
    """Times the default path and, with `sweep` ("tiled", "planes", "gluon"), a grid."""
    qw, s, z = make_weight(n, k, dtype, seed)
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    w_ref = dequantize(qw, s, z, GROUP, torch.float32)  # [K, N]
    ref = x.float() @ w_ref
    w_dense = w_ref.t().contiguous().to(dtype)  # [N, K], what nn.Linear holds
    del w_ref
    dense = [w_dense] + [w_dense.clone() for _ in range(copies_for(n * k * 2) - 1)]
    ms_dense = bench_graph([lambda w=w: torch.matmul(x, w.t()) for w in dense])
    del dense
    quant = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone())
                            for _ in range(copies_for(n * k // 2) - 1)]
    perm = torch.randperm(k, device=DEV).int()

    def check(fn):
        out = torch.full((rows, n), float("nan"), device=DEV, dtype=dtype)
        try:
            fn(out)
        except Exception as e:  # a config the compiler rejects: report, keep sweeping
            print("failed:", type(e).__name__, str(e)[:200])
            return float("inf")
        return rel_err(out, ref)

    results = []
    default = w4a16.choose(x, n, GROUP)  # None: dequantize + cuBLAS
    err = check(lambda o: w4a16.w4a16_gemm(x, qw, s, z, GROUP, out=o))
    if not err < 1e-2:
        raise AssertionError(f"default n={n} k={k} rows={rows} {dtype}: rel err {err}")
    ms = bench_graph([lambda q=q: w4a16.w4a16_gemm(x, *q, GROUP) for q in quant])
    ms_perm = bench_graph([lambda q=q: w4a16.w4a16_gemm(x, *q, GROUP, perm=perm) for q in quant])
    ms_eager = bench_eager(lambda: w4a16.w4a16_gemm(x, qw, s, z, GROUP))
    results.append(("awq", "default", default, ms, err))
    results.append(("gptq", "default+act_order", default, ms_perm, err))
    results.append(("awq", "default_eager", default, ms_eager, err))
    if rows >= 16:  # where the dequantize-then-cuBLAS path could win
        err = check(lambda o: w4a16.w4a16_dequant_matmul(x, qw, s, z, GROUP, out=o))
        ms_dq = bench_graph([lambda q=q: w4a16.w4a16_dequant_matmul(x, *q, GROUP) for q in quant])
        results.append(("awq", "dequant_matmul", None, ms_dq, err))
    if w4a16.use_dequant_matmul(rows, n, k):  # the tiled Triton kernel the dispatcher skips
        cfg = w4a16.pick_config(rows, n, k, GROUP)
        err = check(lambda o: w4a16_prefill(x, qw, s, z, GROUP, out=o, config=cfg))
        ms_tri = bench_graph([lambda q=q: w4a16_prefill(x, *q, GROUP, config=cfg)
                              for q in quant])
        results.append(("awq", "triton_prefill", cfg, ms_tri, err))
    if sweep:
        configs = sweep_configs(sweep, rows)
        for cfg, fn in configs:
            err = check(lambda o, cfg=cfg, fn=fn: fn(x, qw, s, z, GROUP, out=o, config=cfg))
            if not err < 1e-2:
                print(f"WRONG n={n} k={k} rows={rows} {cfg}: rel err {err}")
                results.append(("awq", "sweep_wrong", cfg, float("inf"), err))
                continue
            ms_c = bench_graph([lambda q=q, cfg=cfg, fn=fn: fn(x, *q, GROUP, config=cfg)
                                for q in quant])
            results.append(("awq", "sweep", cfg, ms_c, err))
    if rows == 1:  # last: the table reads results[0..2] by position
        results.append(("int4_read", "stream_floor", None, read_floor(quant), 0.0))
    return ms_dense, results


def floor_note(results, ms_dense):
    floor = [r[3] for r in results if r[1] == "stream_floor"]
    return f"read-floor {floor[0] * 1e3:5.1f}us ({ms_dense / floor[0]:4.2f}x) " if floor else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    sweep = ap.add_mutually_exclusive_group()
    sweep.add_argument("--sweep", dest="sweep", action="store_const", const="tiled",
                       help="sweep the decode and split-K tiled configs")
    sweep.add_argument("--planes", dest="sweep", action="store_const", const="planes",
                       help="sweep only the plane-major tiled configs (rows > 16)")
    sweep.add_argument("--gluon", dest="sweep", action="store_const", const="gluon",
                       help="sweep only the Gluon kernel's configs (rows > 16, sm_90)")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    args = ap.parse_args()
    env = environment()
    lines = []
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"w4a16_gemm_{time.strftime('%Y-%m-%dT%H%M%S')}.jsonl"
    # full-size correctness in fp16 as well (the timed runs check bf16)
    for n, k in SHAPES:
        for rows in (1, 16, 256) if DEV == "cuda" else (1,):
            run_case(n, k, rows, torch.float16 if DEV == "cuda" else DTYPE, None, 1)
    for n, k in SHAPES:
        for rows in args.rows if DEV == "cuda" else ROWS:
            ms_dense, results = run_case(n, k, rows, DTYPE, args.sweep, seed=0)
            records = []
            records.append({**env, "kind": "w4a16_gemm", "method": "bf16", "impl": "torch_matmul",
                            "rows": rows, "n": n, "k": k, "ms": ms_dense, "speedup_vs_bf16": 1.0})
            for method, how, cfg, ms, err in results:
                records.append({**env, "kind": "w4a16_gemm", "method": method, "impl": how,
                                "config": repr(cfg), "group_size": GROUP, "rows": rows, "n": n,
                                "k": k, "ms": ms, "speedup_vs_bf16": ms_dense / ms,
                                "rel_err": err})
            with path.open("a") as f:  # per case, so a run cut short keeps what it measured
                for r in records:
                    f.write(json.dumps(r) + "\n")
            best = min((r for r in results if r[1] in ("default", "sweep", "dequant_matmul",
                                                       "triton_prefill")), key=lambda r: r[3])
            dflt = results[0]
            gbytes = (n * k / 2 + rows * k * 2 + rows * n * 2) / 1e9
            print(f"{n} {k} {rows} done", flush=True)
            lines.append(f"{n:6d} {k:6d} {rows:4d}  bf16 {ms_dense * 1e3:8.1f}us  "
                         f"w4 {dflt[3] * 1e3:8.1f}us ({ms_dense / dflt[3]:4.2f}x, "
                         f"{gbytes / dflt[3] * 1e3 / 1e3:5.2f} TB/s)  act-order "
                         f"{ms_dense / results[1][3]:4.2f}x  best {best[3] * 1e3:8.1f}us "
                         f"({ms_dense / best[3]:4.2f}x) eager {results[2][3] * 1e3:6.1f}us "
                         f"{floor_note(results, ms_dense)}"
                         f"{best[2]}")
    print(env["gpu"], "torch", torch.__version__, "triton", triton.__version__)
    print("     n      k rows")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
