"""What the sampling extras cost per step, sampler alone, on random logits: plain greedy, then
every row with a repetition penalty and top_logprobs=5; and the penalty counts kept
incrementally (one scatter of the sampled tokens) against rebuilding them from the token ids
every step. Runs from a source checkout without installing (for the device machine):

    python benchmarks/sampler_extras.py --batch 256 --vocab 128256 --context 1024
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for name, path in (("pagedserve", ROOT / "pagedserve"), ("pagedserve.executor",
                                                         ROOT / "executor_svc")):
    if name not in sys.modules:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod

from pagedserve.executor.penalties import TokenCounts  # noqa: E402
from pagedserve.executor.sampler import (  # noqa: E402
    Sampler,
    SamplingBatch,
    SamplingSpec,
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

    res = {name: timed(fn, dev, args.steps) for name, fn in (
        ("plain greedy", lambda: step(plain)),
        ("repetition_penalty + top_logprobs=5", lambda: step(extras)),
        ("counts rebuilt from token ids", rebuild),
        ("counts incremental (one scatter)", record))}
    print(f"{dev} batch {b} vocab {v} context {args.context}: ms per step")
    for name, ms in res.items():
        print(f"  {name:40s} {ms:8.3f}")


if __name__ == "__main__":
    main()
