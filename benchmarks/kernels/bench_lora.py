"""Multi-LoRA kernels (kernels/lora.py) against the GEMMs they ride on.

    python3 benchmarks/kernels/bench_lora.py                  # GPU: Llama-3.1-8B shapes, bf16
    python3 benchmarks/kernels/bench_lora.py --smoke          # CPU interpreter, tiny shapes

Each of a decoder layer's four projections (fused qkv, o, fused gate_up, down) is timed as the
executor runs it: the base layer alone (F.linear, bf16) and the same layer wrapped in
executor_svc.lora.LoraLinear with every token of the step carrying one of ADAPTERS adapters
(spread uniformly, so the step's tokens form one segment per adapter: the worst case short of
one adapter per token, which grouping by slot rules out). Decode at 1, 16, 64, 256 tokens,
prefill at 2048 and 8192; ranks 16 and 64. Timing: medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph; decode steps are replayed as graphs in the executor) for
decode, of do_bench for prefill (eager, as served). Records (family `lora`, kind
`lora_kernel`): base_ms, lora_ms (the wrapped layer), delta_ms (their difference: what the
adapters add) and delta_vs_base.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    p.add_argument("--tokens", nargs="*", type=int, default=None)
    p.add_argument("--ranks", nargs="*", type=int, default=None)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--sweep", action="store_true",
                   help="time shrink and expand alone over launch configs (printed, not "
                        "recorded): the fastest per shape beside the default's")
    return p.parse_args()


ARGS = parse()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    from pagedserve.kernels._interpreter import fix_interpreter_index

    fix_interpreter_index()
    os.environ.setdefault("PAGEDSERVE_RESULTS", tempfile.mkdtemp(prefix="bench_lora_"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.testing  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import write_records  # noqa: E402
from pagedserve import kernels  # noqa: E402
from pagedserve.executor.lora import LoraLinear, LoraStep  # noqa: E402

DEV = torch.device("cpu" if ARGS.smoke else "cuda")
DT = torch.float32 if ARGS.smoke else torch.bfloat16
# Llama-3.1-8B: hidden 4096, 32 query and 8 KV heads of 128, MLP 14336
HIDDEN, Q, KV, INTER = (64, 64, 16, 96) if ARGS.smoke else (4096, 4096, 1024, 14336)
MODULES = {  # name: (in, [(part, out)])
    "qkv": (HIDDEN, [("q_proj", Q), ("k_proj", KV), ("v_proj", KV)]),
    "o": (Q, [("o_proj", HIDDEN)]),
    "gate_up": (HIDDEN, [("gate_proj", INTER), ("up_proj", INTER)]),
    "down": (INTER, [("down_proj", HIDDEN)]),
}
DECODE, PREFILL = (1, 16, 64, 256), (2048, 8192)


def bench(fn, graph: bool) -> float:
    if ARGS.smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def layer(name: str, h_in: int, parts: list[tuple[str, int]], rank: int, step: LoraStep):
    """(base, wrapped): one projection with ADAPTERS + 1 slots of N(0, 0.02) adapters, laid out
    as LoraSlots lays them (parts' A stacked along the rank, their B along the output)."""
    out = sum(n for _, n in parts)
    base = nn.Linear(h_in, out, bias=False, device=DEV, dtype=DT)
    nn.init.normal_(base.weight, 0, 0.02)
    s = ARGS.adapters + 1
    slots = SimpleNamespace(
        rank=rank, sizes={name: tuple(n for _, n in parts)},
        a={name: torch.empty(1, s, len(parts) * rank, h_in, device=DEV, dtype=DT).normal_(0, 0.02)},
        b={name: torch.empty(1, s, out, rank, device=DEV, dtype=DT).normal_(0, 0.02)})
    return base, LoraLinear(base, 0, name, slots, step, kernels.get_ops(
        "torch" if ARGS.smoke else "triton"))


def sweep() -> None:
    """Each kernel alone (graph replays) at 8 adapters, rank 16, over launch configs."""
    for name in ("qkv", "gate_up", "down"):
        for t in ARGS.tokens or (16, 256, 2048):
            sweep_shape(name, t)


def sweep_shape(name: str, t: int) -> None:
    from pagedserve.kernels import lora as kl

    h_in, parts = MODULES[name]
    step = LoraStep(DEV)
    _, wrapped = layer(name, h_in, parts, 16, step)
    x = torch.randn(t, h_in, device=DEV, dtype=DT)
    segs = min(t, ARGS.adapters)
    step.begin(np.arange(t + 1), (np.arange(t) % ARGS.adapters + 1).astype(np.int64))
    rows, starts, slots = step.current
    a, b = wrapped.slots.a[name][0], wrapped.slots.b[name][0]
    out = torch.empty(t, a.shape[1], device=DEV)
    y = torch.zeros(t, b.shape[1], device=DEV, dtype=DT)

    def shrink() -> None:
        kl.lora_shrink(x, a, starts, slots, out, rows)

    def expand() -> None:
        kl.lora_expand(out, b, starts, slots, y, 0, rows, wrapped.parts)

    default_shrink, default_expand = kl.shrink_config, kl.expand_config
    block_m = kl.block_m_for(t, segs)
    base = default_shrink(block_m, kl.max_tiles(t, segs, block_m), h_in)
    splits = sorted({max(1, min(h_in // 128, int(base["SPLIT_K"] * f))) for f in (0.5, 1, 2, 4)})
    for kernel, fn, grid, default in (
            ("shrink", shrink, [{"SPLIT_K": sk, "BLOCK_K": bk, "num_warps": w}
                                for sk in splits for bk in (32, 64, 128) for w in (2, 4)], base),
            ("expand", expand, [{"BLOCK_N": bn, "num_warps": w}
                                for bn in (32, 64, 128, 256) for w in (2, 4, 8)],
             default_expand(block_m, max(n for _, n in parts)))):
        times = {}
        for cfg in grid:
            setter = "shrink_config" if kernel == "shrink" else "expand_config"
            setattr(kl, setter, lambda *_, cfg=cfg: dict(cfg))
            try:
                times[json.dumps(cfg)] = bench(fn, True)
            except Exception as e:  # a config the kernel cannot run (resources)
                print(f"  {kernel} {cfg}: {type(e).__name__}", flush=True)
            finally:
                kl.shrink_config, kl.expand_config = default_shrink, default_expand
        best = min(times, key=times.get)
        print(f"{name:8s} T={t:5d} {kernel}: default {json.dumps(default)} "
              f"{times.get(json.dumps(default), float('nan')) * 1e3:.1f} us, best {best} "
              f"{times[best] * 1e3:.1f} us", flush=True)
    step.end()


def main() -> None:
    if ARGS.sweep:
        sweep()
        return
    torch.manual_seed(0)
    tokens = ARGS.tokens or ([1, 16] if ARGS.smoke else [*DECODE, *PREFILL])
    ranks = ARGS.ranks or [16, 64]
    records = []
    for rank in ranks:
        for name, (h_in, parts) in MODULES.items():
            step = LoraStep(DEV)
            base, wrapped = layer(name, h_in, parts, rank, step)
            for t in tokens:
                x = torch.randn(t, h_in, device=DEV, dtype=DT)
                # every token with an adapter, uniformly over them: slots 1..ADAPTERS
                slots = (np.arange(t) % ARGS.adapters + 1).astype(np.int64)
                step.begin(np.arange(t + 1), slots)
                graph = t <= max(DECODE)
                with torch.no_grad():
                    base_ms = bench(lambda base=base, x=x: base(x), graph)
                    lora_ms = bench(lambda wrapped=wrapped, x=x: wrapped(x), graph)
                step.end()
                rec = {"kind": "lora_kernel", "module": name, "tokens": t, "rank": rank,
                       "adapters": ARGS.adapters, "segments": min(t, ARGS.adapters),
                       "graph": graph, "base_ms": base_ms, "lora_ms": lora_ms,
                       "delta_ms": lora_ms - base_ms,
                       "delta_vs_base": (lora_ms - base_ms) / base_ms,
                       **({"smoke": True} if ARGS.smoke else {})}
                records.append(rec)
                print(f"rank {rank:3d} {name:8s} T={t:5d}: base {base_ms * 1e3:8.1f} us, "
                      f"+LoRA {(lora_ms - base_ms) * 1e3:8.1f} us "
                      f"({rec['delta_vs_base']:.2f}x)", flush=True)
    print("wrote", write_records("lora", records))


if __name__ == "__main__":
    main()
