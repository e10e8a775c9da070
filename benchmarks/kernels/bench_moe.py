"""Fused MoE (kernels/fused_moe.py) against the torch expert loop (kernels/moe_reference.py).

    python3 benchmarks/kernels/bench_moe.py                 # GPU: both shapes, bf16
    python3 benchmarks/kernels/bench_moe.py --smoke         # CPU interpreter, tiny shapes
    python3 benchmarks/kernels/bench_moe.py --tune [--shapes qwen3_30b_a3b] [--tokens 1 16]
                                                            # tiles per shape and token count,
                                                            # the best into kernels/moe_configs.json
    python3 benchmarks/kernels/bench_moe.py --decode [--shapes ...] [--tokens 1 4]
                                                            # moe_decode (GEMVs) over its tiles
                                                            # against the grouped GEMMs

Shapes: Qwen3-30B-A3B (H 2048, I 768, E 128, top-8) and Mixtral-8x7B (H 4096, I 14336, E 8,
top-2), TP 1. Decode at 1, 16, 64, 256 tokens, prefill at 4096 and 16384; fresh N(0, 0.02)
weights, random router logits routed with renormalisation. Timing: medians of
triton.testing.do_bench (it clears L2 before each run): impl `triton_eager` and `torch` (the
loop syncs on the host), and of CUDA-graph replays (do_bench_cudagraph) for impl `triton`, as
the executor runs decode steps. A replay cycles through copies of the experts (record field
`weight_copies`) until it reads COLD_L2 L2 caches' worth of weights: a model's step reads each
layer's experts once, from HBM, while one layer's timed alone stays in L2 (Qwen3-30B-A3B's 8
experts at one token are 75 MB; the L2 is 50). Records (family `kernels`, kind `fused_moe`):
ms, TB/s of the bytes touched (the distinct experts' weights + x read + out written), TFLOP/s
(2 T k 3 H I), the fraction of the copy and bf16 GEMM ceilings measured in the same run, and
the relative error against the torch loop; kind `moe_align` times the alignment alone (the
one-program kernel against torch ops), kind `moe_tune_sweep` each swept config (report.py
keeps the best per GEMM), kind `moe_decode` (--decode) routed_moe's grouped GEMMs (impl
`grouped`) and moe_decode's GEMVs at their default tiles (`triton`) from the router's logits,
kind `moe_decode_sweep` the fastest of the tiles tried (`config`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.timing import interpret, median_ms  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {"qwen3_30b_a3b": Shape(2048, 768, 128, 8), "mixtral_8x7b": Shape(4096, 14336, 8, 2)}
SMOKE_SHAPES = {"tiny": Shape(64, 32, 8, 2)}
DECODE, PREFILL = (1, 16, 64, 256), (4096, 16384)
# in the order tuned (a --budget-s run stops between them): W1's decode batch, then the other
# decode sizes (they reuse its compiled tiles), prefill
TUNE_TOKENS = (256, 1, 16, 64, 4096, 16384, 1024)
COLD_L2 = 4  # a timed replay reads at least this many L2 caches of expert weights
MAX_COPIES = 16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    p.add_argument("--tune", action="store_true", help="sweep tiles, write the best")
    p.add_argument("--shapes", nargs="*", default=None, help="names of SHAPES (default: all)")
    p.add_argument("--tokens", nargs="*", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=None,
                   help="--tune: start no token count past this many seconds (per shape, an "
                        "equal share); what was tuned is written as it goes")
    p.add_argument("--decode", action="store_true",
                   help="moe_decode's GEMVs (over tile choices) against the grouped GEMMs, "
                        "both from the router's logits, at 1-8 tokens")
    p.add_argument("--configs", type=Path, default=None,
                   help="file --tune merges into (default kernels/moe_configs.json; a scratch "
                        "file with --smoke)")
    return p.parse_args()


ARGS = parse()
if ARGS.smoke:
    interpret("bench_moe_")

import torch  # noqa: E402

from benchmarks.common import write_records  # noqa: E402
from pagedserve.kernels import fused_moe as fm  # noqa: E402
from pagedserve.kernels import moe_reference as ref  # noqa: E402

DEV = torch.device("cpu" if ARGS.smoke else "cuda")
DT = torch.float32 if ARGS.smoke else torch.bfloat16


def bench(fn, graph: bool = False) -> float:
    """Median ms (the torch loop syncs: it cannot be captured in a graph)."""
    return median_ms(fn, graph, ARGS.smoke)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ceilings() -> tuple[list[dict], float, float]:
    """A 1 GiB device copy (bytes read + written) and an 8192^3 bf16 GEMM, this run's bounds."""
    n = (1 << 20) if ARGS.smoke else (1 << 30)
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    tbps = 2 * n / ms / 1e9
    m = 256 if ARGS.smoke else 8192
    a, b = (torch.randn(m, m, device=DEV, dtype=DT) for _ in range(2))
    ms_mm = bench(lambda: a @ b)
    tflops = 2 * m**3 / ms_mm / 1e9
    print(f"ceilings: copy {tbps:.2f} TB/s, {DT} GEMM {tflops:.0f} TFLOP/s", flush=True)
    return [{"kind": "ceiling_copy", "impl": "torch", "ms": ms, "tbps": tbps, "bytes": 2 * n},
            {"kind": "ceiling_gemm_bf16", "impl": "torch", "ms": ms_mm, "tflops": tflops,
             "m": m, "n": m, "k": m}], tbps, tflops


def make_experts(s: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.empty(s.experts, 2 * s.inter, s.hidden, device=DEV, dtype=DT).normal_(0, 0.02)
    w2 = torch.empty(s.experts, s.hidden, s.inter, device=DEV, dtype=DT).normal_(0, 0.02)
    return w13, w2


def weight_copies(touched: int, weight_bytes: int) -> int:
    """How many copies of the experts a timed replay cycles through for its weight reads to
    come from HBM, not L2 (touched: the bytes of weight one pass reads); at most what a
    quarter of the free memory holds."""
    if DEV.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    fit = torch.cuda.mem_get_info(DEV)[0] // 4 // max(weight_bytes, 1)
    return max(1, min(-(-COLD_L2 * l2 // max(touched, 1)), fit, MAX_COPIES))


def cycled(fns: list) -> functools.partial:
    """One pass of each of fns (one per copy of the experts), in order."""
    return functools.partial(lambda fns: [f() for f in fns], fns)


def make_batch(s: Shape, tokens: int):
    x = torch.randn(tokens, s.hidden, device=DEV, dtype=DT)
    logits = torch.randn(tokens, s.experts, device=DEV)
    weights, ids = ref.moe_route(logits, s.top_k, True)
    return x, weights, ids


def run_shape(name: str, s: Shape, tokens: list[int], copy_tbps: float, gemm_tflops: float):
    records = []
    copies = [make_experts(s)]
    w13, w2 = copies[0]
    elt = w13.element_size()
    for t in tokens:
        x, weights, ids = make_batch(s, t)
        out = torch.empty_like(x)
        ws = torch.empty(fm.workspace_size(t, s.top_k, s.hidden, s.inter), device=DEV, dtype=DT)
        args = (x, w13, w2, weights, ids)
        ours = functools.partial(fm.fused_moe, *args, out=out, workspace=ws)
        fns = {"triton": ours, "triton_eager": ours, "torch": functools.partial(ref.fused_moe,
                                                                                *args)}
        err = rel_err(fns["triton"](), fns["torch"]())
        hit = int(ids.unique().numel())
        nbytes = hit * 3 * s.hidden * s.inter * elt + 2 * t * s.hidden * x.element_size()
        flops = 2 * t * s.top_k * 3 * s.hidden * s.inter
        phase = "decode" if t <= max(DECODE) else "prefill"
        n = weight_copies(nbytes, (w13.numel() + w2.numel()) * elt)
        copies += [make_experts(s) for _ in range(n - len(copies))]
        fns["triton"] = cycled([functools.partial(fm.fused_moe, x, a, b, weights, ids, out=out,
                                                  workspace=ws) for a, b in copies[:n]])
        for impl, fn in fns.items():
            reps = n if impl == "triton" else 1
            ms = bench(fn, graph=impl == "triton") / reps
            tbps, tflops = nbytes / ms / 1e9, flops / ms / 1e9
            records.append({"kind": "fused_moe", "shape": name, "tokens": t, "impl": impl,
                            "phase": phase, "dtype": str(DT).removeprefix("torch."), "ms": ms,
                            "tbps": tbps, "tflops": tflops, "experts_hit": hit, "bytes": nbytes,
                            "flops": flops, "of_copy": tbps / copy_tbps,
                            "of_gemm": tflops / gemm_tflops, "rel_err_vs_torch": err,
                            "hidden": s.hidden, "inter": s.inter, "experts": s.experts,
                            "top_k": s.top_k, "weight_copies": reps, "smoke": ARGS.smoke})
            rate = f"{tbps:6.2f} TB/s" if phase == "decode" else f"{tflops:6.1f} TFLOP/s"
            print(f"{name} T={t:5d} {impl:12s} {ms:9.4f} ms {rate}  err {err:.1e}", flush=True)
        if err > 2e-2:
            raise SystemExit(f"{name} T={t}: Triton disagrees with the torch loop ({err:.1e})")
        if t * s.top_k <= fm.ALIGN_ONE_PROGRAM:
            records += time_align(name, s, w13, ids)
    return records


def time_align(name: str, s: Shape, w13: torch.Tensor, ids: torch.Tensor) -> list[dict]:
    bm = fm.pick_config(ids.shape[0], s.top_k, w13, DT).block_m
    out = []
    for impl, fn in (("triton_one_program", fm.moe_align_block_size),
                     ("torch", ref.moe_align_block_size)):
        ms = bench(lambda fn=fn: fn(ids, bm, s.experts))
        out.append({"kind": "moe_align", "shape": name, "tokens": ids.shape[0], "impl": impl,
                    "block_m": bm, "ms": ms, "smoke": ARGS.smoke})
        print(f"{name} T={ids.shape[0]:5d} align {impl:18s} {ms * 1e3:8.1f} us", flush=True)
    return out


def decode_grid(s: Shape) -> list[tuple[fm.DecodeTiles, fm.DecodeTiles]]:
    """moe_decode's default tiles, then GEMV 1's alternatives (GEMV 2 at its default), then
    GEMV 2's (GEMV 1 at its default)."""
    up, down = fm.decode_tiles(s.inter, s.hidden), fm.decode_tiles(s.hidden, s.inter)
    if ARGS.smoke:
        return [(up, down), (fm.DecodeTiles(8, 16), fm.DecodeTiles(16, 8))]
    alts = [fm.DecodeTiles(bn, bk, w) for bn, bk, w in
            ((2, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (4, 2048, 8))]
    return ([(up, down)] + [(a, down) for a in alts if a != up]
            + [(up, a) for a in alts if a != down])


def run_decode(name: str, s: Shape, tokens: list[int]) -> list[dict]:
    """routed_moe's two ways from the router's logits, each a CUDA-graph replay cycling
    through copies of the experts (cold weights): `grouped` (moe_route, alignment, the
    grouped GEMMs, moe_sum, as the PAGEDSERVE_MOE_FUSE_* switches of this run say) and
    `decode` (moe_decode) at each tile choice."""
    copies = [make_experts(s)]
    w13, w2 = copies[0]
    elt = w13.element_size()
    records = []
    for t in tokens:
        x = torch.randn(t, s.hidden, device=DEV, dtype=DT)
        logits = torch.randn(t, s.experts, device=DEV, dtype=DT)
        want = ref.routed_moe(x, logits, s.top_k, True, w13, w2)
        hit = int(fm.moe_route(logits, s.top_k, True)[1].unique().numel())
        nbytes = hit * 3 * s.hidden * s.inter * elt
        n = weight_copies(nbytes, (w13.numel() + w2.numel()) * elt)
        copies += [make_experts(s) for _ in range(n - len(copies))]
        grouped = functools.partial(fm.routed_moe, x, logits, s.top_k, True)
        decode = functools.partial(fm.moe_decode, x, logits, s.top_k, True)
        variants = [("grouped", None, grouped)] + [
            ("decode", tiles, functools.partial(decode, tiles=tiles)) for tiles in decode_grid(s)]
        best, timed = None, 0
        for impl, tiles, fn in variants:
            try:
                err = rel_err(fn(w13, w2), want)  # (compiles outside the graph)
                ms = bench(cycled([functools.partial(fn, a, b) for a, b in copies[:n]]),
                           graph=not ARGS.smoke) / n
            except Exception as e:  # noqa: BLE001  (a tile the compiler refuses)
                print(f"{name} T={t} {impl} {tiles}: {type(e).__name__}: {e}", flush=True)
                continue
            shown = " ".join(f"{c.block_n}x{c.block_k}/{c.num_warps}" for c in tiles or ())
            print(f"{name} T={t} {impl:8s} {shown:19s} {ms * 1e3:8.1f} us "
                  f"{nbytes / ms / 1e9:5.2f} TB/s err {err:.1e}", flush=True)
            if err > 2e-2:
                raise SystemExit(f"{name} T={t} {impl}: disagrees with the torch loop ({err:.1e})")
            base = {"shape": name, "tokens": t, "top_k": s.top_k, "ms": ms,
                    "tbps": nbytes / ms / 1e9, "experts_hit": hit, "bytes": nbytes,
                    "rel_err_vs_torch": err, "weight_copies": n, "smoke": ARGS.smoke}
            if impl == "grouped" or tiles == variants[1][1]:  # the grouped path; the defaults
                records.append({"kind": "moe_decode", "impl": "grouped" if impl == "grouped"
                                else "triton", **base})
            if impl == "decode":
                timed += 1
                config = {f"{g}_{f}": getattr(c, f) for g, c in zip(("up", "down"), tiles,
                                                                     strict=True)
                          for f in ("block_n", "block_k", "num_warps")}
                if best is None or ms < best["ms"]:
                    best = {"kind": "moe_decode_sweep", **base, "config": config}
        if best is not None:  # the fastest tiles of this sweep (report.py's sweeps table)
            records.append({**best, "sweep_configs": timed})
    return records


def tune_grid(rows_per_expert: float, tokens: int) -> list[fm.MoeConfig]:
    if ARGS.smoke:
        return [fm.MoeConfig(16, 32, 32, 1, 4, 2), fm.MoeConfig(32, 64, 64, 8, 4, 3)]
    if tokens <= 4:  # a token or few an expert: a GEMV; narrow tiles give every SM a share
        grid = itertools.product((16, 32, 64), (128, 256), (2, 4), (3, 4, 5))
        return [fm.MoeConfig(16, bn, bk, 1, w, st) for bn, bk, w, st in grid]
    if rows_per_expert <= 64:  # decode: the weight read is the work; wide tiles, deep K
        bms = (16, 32) if rows_per_expert <= 16 else (32, 64)
        grid = itertools.product(bms, (64, 128, 256), (128, 256), (4,), (2, 4))
        return [fm.MoeConfig(bm, bn, bk, 1 if bm == 16 else 16, w, st)
                for bm, bn, bk, w, st in grid]
    grid = itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4))
    return [fm.MoeConfig(bm, bn, bk, 8, w, st) for bm, bn, bk, w, st in grid
            if bn * bk <= 256 * 64 or bm == 64]


def tune_shape(name: str, s: Shape, tokens: list[int], path: Path, budget_s: float | None
               ) -> list[dict]:
    """Each GEMM timed alone per config (CUDA-graph replays); for each BLOCK_M the best of each
    GEMM, then the BLOCK_M whose two bests add up least (one alignment serves both). Each token
    count's pair is merged into `path` as soon as it is chosen. Each GEMM's replay cycles
    through copies of its weight (weight_copies): cold, as in a model's step."""
    copies = [make_experts(s)]
    w13, w2 = copies[0]
    elt = w13.element_size()
    records = []
    start = time.monotonic()
    for t in tokens:
        if budget_s is not None and time.monotonic() - start > budget_s:
            print(f"{name}: budget spent, not tuned: {tokens[tokens.index(t):]}", flush=True)
            break
        entries: dict[str, dict[str, dict]] = {}
        x, weights, ids = make_batch(s, t)
        pairs = t * s.top_k
        c1 = torch.empty(pairs, 2 * s.inter, device=DEV, dtype=DT)
        c2 = torch.randn(pairs, s.inter, device=DEV, dtype=DT)
        c3 = torch.empty(pairs, s.hidden, device=DEV, dtype=DT)
        flat_w = weights.reshape(-1)
        hit = int(ids.unique().numel())
        n = weight_copies(hit * s.hidden * s.inter * elt, (w13.numel() + w2.numel()) * elt)
        copies += [make_experts(s) for _ in range(n - len(copies))]
        best: dict[int, dict[str, tuple[float, fm.MoeConfig]]] = {}
        for cfg in tune_grid(pairs / s.experts, t):
            align = fm.moe_align_block_size(ids, cfg.block_m, s.experts)
            gemms = {"up": [functools.partial(fm.moe_gemm, x, a, c1, align, s.top_k, cfg)
                            for a, _ in copies[:n]],
                     "down": [functools.partial(fm.moe_gemm, c2, b, c3, align, 1, cfg,
                                                routed_weights=flat_w) for _, b in copies[:n]]}
            for gemm, fns in gemms.items():
                try:
                    fns[0]()  # compiles outside the graph; a refused config raises here
                    # decode GEMMs last microseconds: replays, no launch time
                    ms = bench(cycled(fns), graph=True) / n
                except Exception as e:  # noqa: BLE001  (a config the compiler refuses)
                    print(f"{name} T={t} {gemm} {cfg}: {type(e).__name__}", flush=True)
                    continue
                records.append({"kind": "moe_tune_sweep", "shape": name, "tokens": t, "gemm": gemm,
                                **cfg.to_json(), "ms": ms, "weight_copies": n,
                                "smoke": ARGS.smoke})
                slot = best.setdefault(cfg.block_m, {})
                if gemm not in slot or ms < slot[gemm][0]:
                    slot[gemm] = (ms, cfg)
        bm = min((b for b in best if len(best[b]) == 2),
                 key=lambda b: best[b]["up"][0] + best[b]["down"][0])
        for gemm, w in (("up", w13), ("down", w2)):
            e, n, k = w.shape
            key = fm.config_key(e, n, k, DT, w.dtype, DEV)
            entries.setdefault(key, {})[str(t)] = best[bm][gemm][1].to_json()
        ms = best[bm]["up"][0] + best[bm]["down"][0]
        print(f"{name} T={t}: BLOCK_M {bm}, up {best[bm]['up'][1]}, down "
              f"{best[bm]['down'][1]}: {ms:.4f} ms", flush=True)
        merge_configs(path, entries)
    return records


def free_cache() -> None:
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def merge_configs(path: Path, entries: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, buckets in entries.items():
        data.setdefault(key, {}).update(buckets)
        data[key] = dict(sorted(data[key].items(), key=lambda kv: int(kv[0])))
    path.write_text(json.dumps(data, indent=1) + "\n")
    fm.load_configs.cache_clear()  # a bench later in this process reads the new tiles
    print("configs written to", path, flush=True)


def main() -> None:
    shapes = SMOKE_SHAPES if ARGS.smoke else SHAPES
    if ARGS.shapes:
        shapes = {n: shapes[n] for n in ARGS.shapes}
    torch.manual_seed(0)
    if ARGS.decode:
        records = []
        for name, s in shapes.items():
            records += run_decode(name, s, ARGS.tokens or [1, 2, 4, 8])
            free_cache()
    elif ARGS.tune:
        tokens = ARGS.tokens or ([1, 16] if ARGS.smoke else list(TUNE_TOKENS))
        path = ARGS.configs or (Path(tempfile.mkdtemp()) / "moe_configs.json" if ARGS.smoke
                                else fm.CONFIG_FILE)
        if ARGS.smoke and ARGS.configs is None:
            path.write_text(fm.CONFIG_FILE.read_text())
        records = []
        share = None if ARGS.budget_s is None else ARGS.budget_s / len(shapes)
        for name, s in shapes.items():
            records += tune_shape(name, s, tokens, path, share)
            free_cache()
    else:
        tokens = ARGS.tokens or ([1, 16, 256] if ARGS.smoke else [*DECODE, *PREFILL])
        records, copy_tbps, gemm_tflops = ceilings()
        for name, s in shapes.items():
            records += run_shape(name, s, tokens, copy_tbps, gemm_tflops)
            free_cache()
    print("wrote", write_records("kernels", records))


if __name__ == "__main__":
    main()
