"""W4A16 GEMM vs bf16 torch.matmul at Llama-3.1-8B shapes (GPU only; imports only kernels/).

For each shape and row count: checks every kernel config it times against a dequantize+matmul
reference in fp32 (outputs poisoned with NaN first), times the heuristic's choice (what the
model uses) and, with --sweep, a grid of configs, and bf16 torch.matmul in the same run.
Records (kind w4a16_gemm) go to --out as JSONL; a table goes to stdout.

    python benchmarks/quant/bench_w4a16.py --out $OUT [--sweep | --packed | --planes | --gluon]
        [--rows 1 16 32]

--packed sweeps the packed-pair decode configs and the split-K tiled ones (what the defaults
were picked from); at 1 row each shape also gets a read floor: the time to stream its packed
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

from pagedserve.kernels import w4a16  # noqa: E402
from pagedserve.kernels.w4a16_reference import dequantize, pack_int4  # noqa: E402

from benchmarks.common import environment  # noqa: E402

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


def packed_decode_grid(rows):
    """The packed-pair (inline PTX) dequantization, one tl.dot per nibble plane; the first
    sweep (results/w4a16_gemm_2026-11-30T024437.jsonl) found 4 warps and programs covering
    ~1024 of K best, so this one varies split, column tile and pipeline depth around that."""
    return [w4a16.DecodeConfig(block_n=bn, block_k=128, split_k=split, num_stages=stages,
                               dequant="x2planes")
            for bn in (64, 128, 256) for stages in (3, 4, 5) for split in (2, 4, 6, 8, 12, 16)]


PACKED_PREFILL_GRID = [
    # One program per output tile took ~1.4 us per K tile on the H200 whatever the rows, so
    # few tiles meant a slow GEMM (results/w4a16_gemm_2026-11-30T030606.jsonl): split K.
    w4a16.PrefillConfig(bm, bn, bk, 8, warps, stages, dequant=dq, swap_ab=swap, split_k=split)
    for bm, bn, bk, warps, stages, dq, swap in [
        (128, 128, 128, 8, 3, "x2", True), (32, 128, 64, 4, 4, "x2", True),
        (64, 128, 64, 4, 4, "x2", True), (128, 128, 64, 8, 4, "x2", True),
        (256, 128, 64, 8, 3, "x2", True), (128, 128, 64, 8, 4, "x2", False),
        (64, 64, 128, 4, 4, "fp32", False)]
    for split in (2, 4, 8, 16)
]


def planes_grid(rows):
    """Plane-major x, one dot per nibble plane (swap-AB, BLOCK_K 128). sass_w4a16.py shows no
    shared-memory round trip of the weight when BLOCK_N = 16 x warps (one 16-row slab of
    W^T per warp). The first sweep (results/w4a16_gemm_2026-11-30T042134.jsonl, 32-256 rows,
    the grid of commit abd1e5d) set the defaults up to 128 rows; this one looks past them at
    128 and 256: two stages (two programs per SM, one dequantizing while the other multiplies)
    and 16 warps with BLOCK_N 256 (each program re-reads x for half as many weight columns)."""
    if rows < 128:
        return []
    shapes = [(128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 8, 2), (64, 256, 16, 3),
              (64, 256, 16, 4), (128, 256, 16, 2)]
    if rows > 128:
        shapes += [(256, 128, 8, 2), (256, 128, 8, 3)]
    return [w4a16.PrefillConfig(bm, bn, 128, 8, warps, stages, dequant="x2", swap_ab=True,
                                split_k=split, planes=True)
            for bm, bn, warps, stages in shapes for split in (1, 2)]


def gluon_grid(rows):
    """The Gluon kernel (kernels/w4a16_gluon.py) around the rows' M tile: 8 warps (BLOCK_N 128)
    with and without a 128-register cap (two programs per SM), 4 warps at the small tiles."""
    from pagedserve.kernels.w4a16_gluon import GluonConfig

    if rows <= 32:
        shapes = [(32, 8, 3, None), (32, 8, 3, 128), (32, 4, 4, None)]
    elif rows <= 64:
        shapes = [(64, 8, 3, None), (64, 8, 3, 128), (64, 4, 4, None), (32, 8, 3, None)]
    elif rows <= 128:
        shapes = [(128, 8, 3, None), (128, 8, 3, 128), (64, 8, 3, None), (64, 8, 3, 128)]
    else:
        shapes = [(256, 8, 2, None), (256, 8, 2, 128), (128, 8, 3, None), (128, 8, 3, 128)]
    splits = (2, 4, 8) if rows <= 64 else (1, 2, 4)
    return [GluonConfig(bm, warps, stages, split, maxnreg)
            for bm, warps, stages, maxnreg in shapes for split in splits]


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


def decode_grid(rows):
    grid = []
    for bn in (32, 64, 128):
        for target in (264, 528, 1056):
            for dot in (True, False) if rows <= 4 else (True,):
                for bcast in (False, True):
                    grid.append(w4a16.DecodeConfig(block_n=bn, block_k=128, use_dot=dot,
                                                   target_programs=target, bcast_load=bcast))
    grid.append(w4a16.DecodeConfig(lock_reduce=False, use_dot=rows > 4))
    return grid


PREFILL_GRID = [
    w4a16.PrefillConfig(bm, bn, bk, 8, warps, stages, bcast)
    for bm, bn, bk, warps, stages in [(32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
                                      (64, 128, 128, 8, 3), (128, 128, 64, 8, 4),
                                      (128, 256, 64, 8, 3), (64, 256, 64, 8, 4)]
    for bcast in (False, True)
]
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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[len(times) // 2]


def copies_for(nbytes):
    return max(1, int(-(-L2_FLUSH_BYTES // nbytes))) if DEV == "cuda" else 1


def run_case(n, k, rows, dtype, sweep, seed, packed=False, planes=False, gluon=False):
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
    default = w4a16.pick_config(rows, n, k, GROUP)
    if DEV == "cuda" and rows > w4a16.DECODE_MAX_ROWS:  # what w4a16_gemm runs on Hopper
        from pagedserve.kernels import w4a16_gluon

        if w4a16_gluon.available(x, GROUP):
            default = w4a16_gluon.pick_config(rows, n, k) or default
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
        err = check(lambda o: w4a16.w4a16_prefill(x, qw, s, z, GROUP, out=o, config=cfg))
        ms_tri = bench_graph([lambda q=q: w4a16.w4a16_prefill(x, *q, GROUP, config=cfg)
                              for q in quant])
        results.append(("awq", "triton_prefill", cfg, ms_tri, err))
    if sweep or packed or planes or gluon:
        configs = []
        if gluon:
            if rows > w4a16.DECODE_MAX_ROWS:
                from pagedserve.kernels.w4a16_gluon import w4a16_gluon
                configs += [(c, w4a16_gluon) for c in gluon_grid(rows)]
        elif planes:
            if rows > w4a16.DECODE_MAX_ROWS:
                configs += [(c, w4a16.w4a16_prefill) for c in planes_grid(rows)]
        elif rows <= w4a16.DECODE_MAX_ROWS:
            grid = packed_decode_grid(rows) if packed else decode_grid(rows)
            configs += [(c, w4a16.w4a16_decode) for c in grid]
        if rows >= 16 and not (planes or gluon):
            grid = PACKED_PREFILL_GRID if packed else PREFILL_GRID
            configs += [(c, w4a16.w4a16_prefill) for c in grid]
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
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--packed", action="store_true",
                    help="sweep only the packed-pair dequantization configs")
    ap.add_argument("--planes", action="store_true",
                    help="sweep only the plane-major tiled configs (rows > 16)")
    ap.add_argument("--gluon", action="store_true",
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
            run_case(n, k, rows, torch.float16 if DEV == "cuda" else DTYPE, False, 1)
    for n, k in SHAPES:
        for rows in args.rows if DEV == "cuda" else ROWS:
            ms_dense, results = run_case(n, k, rows, DTYPE, args.sweep, seed=0,
                                         packed=args.packed, planes=args.planes,
                                         gluon=args.gluon)
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
