"""Multi-LoRA kernels (kernels/lora.py) against the GEMMs they ride on.

    python3 benchmarks/kernels/bench_lora.py                  # GPU: Llama-3.1-8B shapes, bf16
    python3 benchmarks/kernels/bench_lora.py --smoke          # CPU interpreter, tiny shapes

Each of a decoder layer's four projections (fused qkv, o, fused gate_up, down) is timed as the
executor runs it: the base layer alone (F.linear, bf16) and the same layer wrapped in
executor_svc.lora.LoraLinear with every token of the step carrying one of ADAPTERS adapters
(spread uniformly, so the step's tokens form one segment per adapter: the worst case short of
one adapter per token, which grouping by slot rules out). Decode at 1, 16, 64, 256 tokens,
prefill at 2048 and 8192; ranks 16 and 64 (--tune: launch configs per shape, written to
kernels/lora_configs.json, which the kernels read). Timing: medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph; decode steps are replayed as graphs in the executor) for
decode, of do_bench for prefill (eager, as served). Records (family `lora`, kind
`lora_kernel`): base_ms, lora_ms (the wrapped layer), delta_ms (their difference: what the
adapters add) and delta_vs_base.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.timing import interpret, median_ms  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    p.add_argument("--tokens", nargs="*", type=int, default=None)
    p.add_argument("--ranks", nargs="*", type=int, default=None)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--tune", action="store_true",
                   help="time shrink and expand alone over launch configs, the best into "
                        "kernels/lora_configs.json (printed, not recorded)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="--tune: start no shape past this many seconds")
    p.add_argument("--configs", type=Path, default=None,
                   help="--tune: the file to merge into (default: the installed one)")
    return p.parse_args()


ARGS = parse()
if ARGS.smoke:
    interpret("bench_lora_")

import numpy as np  # noqa: E402
import torch  # noqa: E402
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
    return median_ms(fn, graph, ARGS.smoke)


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


def tune() -> None:
    """Each kernel alone (graph replays; 8 adapters, rank 16) over launch configs at decode and
    prefill shapes; per config key (BLOCK_M and H_in for shrink, BLOCK_M and the widest part
    for expand) the config of least total time over the shapes that share it, merged into
    kernels/lora_configs.json as installed (--configs: another file)."""
    from pagedserve.kernels import lora as kl

    path = ARGS.configs or kl.CONFIG_FILE
    start, totals = time.monotonic(), {}  # (kernel, key) -> {config json: [ms per shape]}
    shapes = [(m, t) for t in ARGS.tokens or (256, 8192, 16) for m in MODULES]
    for name, t in shapes:
        if ARGS.budget_s and time.monotonic() - start > ARGS.budget_s:
            print(f"budget spent: {name} T={t} and later shapes not tuned", flush=True)
            break
        for (kernel, key), times in tune_shape(name, t).items():
            for cfg, ms in times.items():
                totals.setdefault((kernel, key), {}).setdefault(cfg, []).append(ms)
    merged = json.loads(path.read_text()) if path.exists() else {}
    for (kernel, key), by_cfg in totals.items():
        most = max(len(v) for v in by_cfg.values())
        best = min((c for c, v in by_cfg.items() if len(v) == most),
                   key=lambda c: sum(by_cfg[c]))
        merged.setdefault(kernel, {})[key] = json.loads(best)
        print(f"{kernel} {key}: {best} ({sum(by_cfg[best]) * 1e3:.1f} us over {most} shapes)",
              flush=True)
    path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    print("wrote", path)


def tune_shape(name: str, t: int) -> dict[tuple[str, str], dict[str, float]]:
    """{(kernel, config key): {config json: ms}} of one projection at t tokens."""
    from pagedserve.kernels import lora as kl

    h_in, parts = MODULES[name]
    step = LoraStep(DEV)
    _, wrapped = layer(name, h_in, parts, 16, step)
    x = torch.randn(t, h_in, device=DEV, dtype=DT)
    step.begin(np.arange(t + 1), (np.arange(t) % ARGS.adapters + 1).astype(np.int64))
    rows, starts, slots = step.current
    a, b = wrapped.slots.a[name][0], wrapped.slots.b[name][0]
    out = torch.empty(t, a.shape[1], device=DEV)
    y = torch.zeros(t, b.shape[1], device=DEV, dtype=DT)

    def shrink() -> None:
        kl.lora_shrink(x, a, starts, slots, out, rows)

    def expand() -> None:
        kl.lora_expand(out, b, starts, slots, y, 0, rows, wrapped.parts)

    block_m = kl.block_m_for(t, min(t, ARGS.adapters))
    saved, found = dict(kl.CONFIGS), {}
    for kernel, fn, key, grid in (
            ("shrink", shrink, f"{block_m},{h_in}",
             [{"target_programs": p, "BLOCK_K": bk, "num_warps": w}
              for p in (128, 256, 512, 1024, 2048) for bk in (32, 64, 128) for w in (2, 4)]),
            ("expand", expand, f"{block_m},{max(n for _, n in parts)}",
             [{"BLOCK_N": bn, "num_warps": w} for bn in (32, 64, 128, 256) for w in (2, 4, 8)])):
        times = found[kernel, key] = {}
        for cfg in grid:
            kl.CONFIGS = {kernel: {key: cfg}}
            try:
                times[json.dumps(cfg, sort_keys=True)] = bench(fn, True)
            except Exception as e:  # a config the kernel cannot run (resources)
                print(f"  {kernel} {cfg}: {type(e).__name__}", flush=True)
            finally:
                kl.CONFIGS = saved
        best = min(times, key=times.get)
        print(f"{name:8s} T={t:5d} {kernel}: best {best} {times[best] * 1e3:.1f} us "
              f"(of {len(times)})", flush=True)
    step.end()
    return found


def main() -> None:
    if ARGS.tune:
        tune()
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
