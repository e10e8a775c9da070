"""Speculative decoding (docs/speculative_decoding.md): TPOT with drafts against the same server
flags without, at 1 and 16 running, through the real gRPC API.

Prompts are input-grounded chat requests (summarise or edit a given passage, answer from a
given document, repeat code with a change), where n-gram drafts find their tokens; greedy, EOS
honoured (so outputs stay real text), at most --max-tokens each; every prompt runs, `running`
requests at a time. Per request TPOT = (E2EL - TTFT) / (output tokens - 1)
(../shared/BENCHMARKS.md), averaged over the requests of a run; the acceptance rate and mean
accepted length come from the server's spec_decode counters over the same run, and so does
where a step's time goes (`per_step_ms`: the executor's device busy and gap time, its host
time and the scheduler loop's, by phase, per executor step; device times on CUDA only).

outputs_equal says whether the greedy outputs equal the baseline's token for token. In float32
they must (verification is lossless). In bfloat16 a verification step's logits come from a
batch of another shape than a plain decode's, rounded differently, so where two logits nearly
tie the argmax can differ (random weights: nearly always); the speedup is recorded either way.
With --logprobs every request asks for its top 2 (timings then include them) and a difference
is located: `first_difference` names the request, the position, and the gap between the top
two log-probabilities there in each run. A gap near float32's rounding (random weights spread
the logits thin) is a near tie; a wide one is a lossless-verification bug.

    python -m benchmarks.spec_decode --running 1 --running 16 \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.common import model_flags, write_records
from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2_grpc

PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia. It can be seen from outer space and is the world's "
    "biggest single structure made by living organisms. This reef structure is composed of "
    "and built by billions of tiny organisms, known as coral polyps.")
CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
DOCUMENT = (
    "Release notes, version 2.4. The scheduler now preempts the least important request when "
    "the cache is full. The default block size is 16 tokens. Swap space defaults to 4 GiB of "
    "host memory. The metrics port is 8000 and the gRPC port is 50051. Requests with a "
    "priority of 0 are served first; the default priority is 10.")
PROMPTS = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Summarise this passage in two sentences, reusing its wording:\n\n{PASSAGE}",
    f"Rewrite this passage, replacing 'reef' with 'Reef':\n\n{PASSAGE}",
    f"Rename the function to rolling_mean and return the code in full:\n\n{CODE}",
    f"Add type hints to this function and return it in full:\n\n{CODE}",
    f"Copy this code exactly:\n\n{CODE}",
    f"{DOCUMENT}\n\nFrom the notes above: what are the default block size, swap space, "
    "metrics port and gRPC port? Quote the notes.",
    f"{DOCUMENT}\n\nList every default the notes above state, one per line, in their words.",
]


async def one(stub, prompt: str, max_tokens: int, timeout: float, logprobs: bool = False
              ) -> tuple[list[int], float, float, list[float]]:
    """(token ids, TTFT, E2EL, gaps) of one greedy chat request; gaps: with `logprobs`, the
    top log-probability minus the second's at each token (else empty)."""
    req = build_request(chat=[("user", prompt)], max_tokens=max_tokens, temperature=0,
                        logprobs=2 if logprobs else None)
    ids: list[int] = []
    gaps: list[float] = []
    sent = time.perf_counter()
    ttft = math.nan
    async for chunk in stub.Generate(req, timeout=timeout):
        if math.isnan(ttft):
            ttft = time.perf_counter() - sent
        ids.extend(chunk.token_ids)
        gaps.extend(lp.top_logprobs[0] - lp.top_logprobs[1] for lp in chunk.logprobs)
    return ids, ttft, time.perf_counter() - sent, gaps


def first_difference(base, spec) -> dict | None:
    """Where two runs' outcomes first differ: the request, the token position, and each run's
    top-2 log-probability gap there (None where not asked for); None when they are equal."""
    for i, (b, s) in enumerate(zip(base, spec, strict=True)):
        b_ids, s_ids = b[0], s[0]
        if b_ids == s_ids:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(b_ids, s_ids, strict=False)) if x != y),
                   min(len(b_ids), len(s_ids)))
        b_gap, s_gap = (round(o[3][pos], 7) if pos < len(o[3]) else None for o in (b, s))
        return {"request": i, "position": pos, "baseline_top2_gap": b_gap,
                "spec_top2_gap": s_gap}
    return None


async def drive(address: str, running: int, max_tokens: int, timeout: float = 1800,
                logprobs: bool = False):
    """Every prompt at least once (the prompts in turn, max(8, running) requests), `running`
    at a time; their outcomes in order."""
    gate = asyncio.Semaphore(running)

    async def gated(stub, prompt):
        async with gate:
            return await one(stub, prompt, max_tokens, timeout, logprobs)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(gated(stub, PROMPTS[i % len(PROMPTS)])
                                      for i in range(max(len(PROMPTS), running))))


def tpot_ms(outcomes) -> float:
    tpots = [(e2el - ttft) / (len(ids) - 1) for ids, ttft, e2el, _ in outcomes if len(ids) > 8]
    return statistics.fmean(tpots) * 1e3 if tpots else math.nan


SPEC_KEYS = ("pagedserve_spec_decode_num_drafts_total",
             "pagedserve_spec_decode_num_draft_tokens_total",
             "pagedserve_spec_decode_num_accepted_tokens_total")


STEP_PARTS = {"device_busy": 'pagedserve_executor_device_seconds_total{state="busy"}',
              "device_gap": 'pagedserve_executor_device_seconds_total{state="gap"}'}
LOOP = "pagedserve_scheduler_loop_seconds_total"
EXECUTOR = "pagedserve_executor_host_seconds_total"
STEPS = "pagedserve_executor_steps_total"


def per_step_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters' increase, in ms per executor step: device busy and gap, each phase of
    the scheduler's loop (loop_<phase>) and of the executor's host time (executor_<phase>)."""
    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = sum(grew(k) for k in after if k.startswith(STEPS + "{"))
    if not steps:
        return {}
    out = {name: grew(key) * 1e3 / steps for name, key in STEP_PARTS.items()}
    for prefix, name in ((LOOP, "loop_"), (EXECUTOR, "executor_")):
        for key in after:
            if key.startswith(prefix + "{"):
                out[name + key.split('"')[1]] = grew(key) * 1e3 / steps
    return {"steps": steps, **{k: round(v, 4) for k, v in out.items()}}


def measure(flags: list[str], runnings: list[int], max_tokens: int, rounds: int,
            logprobs: bool = False) -> dict:
    """Per running: the outcomes of the last round, mean TPOT over the rounds, the
    spec_decode counters' increase over them, and where a step's time went."""
    from tests.integration.service import Service

    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", *flags)
    out = {}
    try:
        svc.wait_serving(timeout=900)
        asyncio.run(drive(svc.address, 2, 16))  # warm-up: first kernels, graphs in use
        for running in runnings:
            asyncio.run(drive(svc.address, running, max_tokens, logprobs=logprobs))  # shapes
            before = svc.metrics()
            tpots, outcomes = [], None
            for _ in range(rounds):
                outcomes = asyncio.run(drive(svc.address, running, max_tokens,
                                             logprobs=logprobs))
                tpots.append(tpot_ms(outcomes))
            after = svc.metrics()
            counts = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_KEYS}
            out[running] = (outcomes, statistics.fmean(tpots), counts,
                            per_step_ms(before, after))
    finally:
        svc.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer", default="")
    p.add_argument("--spec", action="append", default=[],
                   help="a --speculative-config JSON to measure (repeatable)")
    p.add_argument("--running", type=int, action="append", default=[])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-flag", action="append", default=[])
    p.add_argument("--logprobs", action="store_true",
                   help="ask each request for its top 2 and locate a difference (see above)")
    args = p.parse_args()
    runnings = args.running or [1, 16]
    specs = args.spec or ['{"method": "ngram", "num_speculative_tokens": 4}']
    flags = [*model_flags(args.model, args.load_format, args.tokenizer), *args.server_flag]
    base = measure(flags, runnings, args.max_tokens, args.rounds, args.logprobs)
    records = []
    for spec in specs:
        cfg = json.loads(spec)
        got = measure([*flags, "--speculative-config", spec], runnings, args.max_tokens,
                      args.rounds, args.logprobs)
        for running in runnings:
            b_out, b_tpot, _, b_steps = base[running]
            s_out, s_tpot, c, s_steps = got[running]
            drafts, drafted, accepted = (c[k] for k in SPEC_KEYS)
            differ = first_difference(b_out, s_out)
            equal = differ is None
            rec = {"kind": "spec_decode", "method": cfg.get("method", "ngram"),
                   "speculative_config": spec, "model": Path(args.model).name,
                   "weights": args.load_format, "running": running,
                   "max_tokens": args.max_tokens, "prompts": "input-grounded chat",
                   "output_tokens": sum(len(o[0]) for o in s_out),
                   "tpot_ms": s_tpot, "tpot_ms_baseline": b_tpot,
                   "speedup": b_tpot / s_tpot,
                   "outputs_equal": equal,
                   **({"first_difference": differ} if differ and args.logprobs else {}),
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_accepted_tokens": 1 + accepted / drafts if drafts else 1.0,
                   "dtype": next((v for f, v in zip(args.server_flag, args.server_flag[1:],
                                                     strict=False) if f == "--dtype"), "auto"),
                   "server_flags": " ".join(args.server_flag),
                   "per_step_ms": s_steps, "per_step_ms_baseline": b_steps}
            records.append(rec)
            print(f"{rec['method']} running={running}: TPOT {s_tpot:.2f} ms vs {b_tpot:.2f} "
                  f"(x{b_tpot / s_tpot:.2f}), acceptance {rec['acceptance_rate']:.2f}, mean "
                  f"accepted {rec['mean_accepted_tokens']:.2f}, outputs equal: {equal}"
                  + (f", first difference: {differ}" if differ else ""),
                  flush=True)
            print(f"  per step (ms): {s_steps}\n  baseline: {b_steps}", flush=True)
    print(write_records("spec_decode", records))


if __name__ == "__main__":
    main()
