"""What the sampling extras cost per step, sampler alone, on random logits: plain greedy, then
every row with a repetition penalty and top_logprobs=5; and the penalty counts kept
incrementally (one scatter of the sampled tokens) against rebuilding them from the token ids
every step. Then temperature 1.0 with every row seeded and none seeded (one exponential race
for the batch), beside the draw the sampler made before it: a torch.Generator and an
exponential_ launch per seeded row. With --record, appends the ms per step to
benchmarks/results/kernels.jsonl (kind sampler_step). Runs from a source checkout without
installing (for the device machine):

    python benchmarks/sampler_extras.py --batch 256 --vocab 128256 --context 1024
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for name, path in (("pagedserve", ROOT / "pagedserve"),
                   ("pagedserve.kernels", ROOT / "kernels"),
                   ("pagedserve.executor", ROOT / "executor_svc")):
    if name not in sys.modules:  # the source tree's packages, their __init__ run
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)])
        sys.modules[name] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)

from pagedserve.executor.penalties import TokenCounts  # noqa: E402
from pagedserve.executor.sampler import (  # noqa: E402
    Sampler,
    SamplingBatch,
    SamplingSpec,
    position_seed,
    read_logprobs,
)


def timed(fn, dev: torch.device, steps: int) -> float:
    """Mean milliseconds per call, synchronized at the ends only (as a serving step is)."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b, v = args.batch, args.vocab
    logits = torch.randn(b, v, device=dev) * 3
    sampler = Sampler(dev, seed=0)
    ids = [torch.randint(0, v, (args.context,)).tolist() for _ in range(b)]
    plain = SamplingBatch([SamplingSpec()] * b, [args.context] * b)
    counts = TokenCounts(v, dev)
    slots = [counts.acquire() for _ in range(b)]
    counts.load([(s, t, args.context // 2) for s, t in zip(slots, ids, strict=True)])
    spec = SamplingSpec(repetition_penalty=1.1, logprobs=5)
    extras = SamplingBatch([spec] * b, [args.context] * b, count_slots=slots, counts=counts)

    def step(batch: SamplingBatch) -> None:
        out = sampler.sample(logits, batch)
        out.tokens.tolist()  # the step's one read-back, as the runner's finish()
        read_logprobs(out)

    def rebuild() -> None:  # the alternative: counts from the token ids, every step
        counts.load([(s, t, args.context // 2) for s, t in zip(slots, ids, strict=True)])

    sampled = logits.argmax(-1)

    def record() -> None:  # what a step adds for the counts (inside sample() already)
        counts.record(torch.tensor(slots, device=dev), sampled)

    seeded = SamplingBatch([SamplingSpec(temperature=1.0, seed=i) for i in range(b)],
                           [args.context] * b)
    unseeded = SamplingBatch([SamplingSpec(temperature=1.0)] * b, [args.context] * b)

    def per_row_generators() -> None:  # the seeded draw before the race: a launch per row
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for i in range(b):
            gen = torch.Generator(device=dev)
            gen.manual_seed(position_seed(i, args.context))
            noise[i].exponential_(generator=gen)
        (probs / noise).argmax(dim=-1).tolist()

    res = {name: timed(fn, dev, args.steps) for name, fn in (
        ("plain greedy", lambda: step(plain)),
        ("temperature 1, every row seeded", lambda: step(seeded)),
        ("temperature 1, no row seeded", lambda: step(unseeded)),
        ("seeded, a Generator per row (before)", per_row_generators),
        ("repetition_penalty + top_logprobs=5", lambda: step(extras)),
        ("counts rebuilt from token ids", rebuild),
        ("counts incremental (one scatter)", record))}
    print(f"{dev} batch {b} vocab {v} context {args.context}: ms per step")
    for name, ms in res.items():
        print(f"  {name:40s} {ms:8.3f}")
    if args.record:
        sys.path.insert(0, str(ROOT))
        from benchmarks.common import write_records

        cmd = "python3 benchmarks/sampler_extras.py " + " ".join(sys.argv[1:])
        print("appended to", write_records("kernels", [
            {"command": cmd, "kind": "sampler_step", "case": name, "batch": b, "vocab": v,
             "ms": ms} for name, ms in res.items()]))


if __name__ == "__main__":
    main()
