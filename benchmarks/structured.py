"""Structured outputs on the GPU (issue 20, item 7): --concurrency JSON-schema requests against
the same number unconstrained, through the real gRPC API on one `pagedserve serve`; TPOT of
each (per request: (last token - first token) / (tokens - 1), then the median), and the
scheduler's host time filling the token bitmasks per step (pagedserve_grammar_bitmask_seconds:
sum / count over the constrained run; since the masks travel after the plan it is not part of
the planning time) and advancing the grammars by each step's tokens
(pagedserve_grammar_accept_seconds), then the same at --wide running for the step-time
breakdown at 256.

Random weights generate random allowed tokens, so a constrained request may end early (its
object closed); TPOT is per token and does not depend on that. The unconstrained requests
ignore EOS and run max_tokens.

    python -m benchmarks.structured --model benchmarks/models/llama3.1-8b --load-format random \\
        --tokenizer <dir with tokenizer files> --concurrency 64 --wide 256

Needs xgrammar (and its apache-tvm-ffi) on the device: carry their wheels in .whl/.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import model_flags, step_breakdown, step_split, write_records

SCHEMA = {  # long enough that random tokens fill most of max_tokens before it closes
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 64},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 12},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 16},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"]},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "tags", "scores", "address", "role"],
}


def one(client, constrained: bool, max_tokens: int, i: int) -> tuple[int, float]:
    """(tokens, TPOT seconds) of one streamed request."""
    kw = dict(json_schema=SCHEMA) if constrained else dict(ignore_eos=True)
    first = last = 0.0
    n = 0
    for resp in client.generate(chat=[("user", f"Describe user {i} as JSON.")],
                                max_tokens=max_tokens, temperature=1.0, seed=i, **kw):
        now = time.perf_counter()
        if n == 0:
            first = now
        last = now
        n += len(resp.token_ids)
    return n, (last - first) / max(1, n - 1)


def run(svc, constrained: bool, concurrency: int, max_tokens: int) -> dict:
    from tests.integration.service import scrape

    before = scrape(svc.metrics_port, svc.model_name)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda i: one(svc.client, constrained, max_tokens, i),
                             range(concurrency)))
    wall = time.perf_counter() - t0
    after = scrape(svc.metrics_port, svc.model_name)
    key = "pagedserve_grammar_bitmask_seconds"
    steps = after.get(key + "_count", 0) - before.get(key + "_count", 0)
    mask_s = after.get(key + "_sum", 0) - before.get(key + "_sum", 0)
    acc = "pagedserve_grammar_accept_seconds"
    accepts = after.get(acc + "_count", 0) - before.get(acc + "_count", 0)
    accept_s = after.get(acc + "_sum", 0) - before.get(acc + "_sum", 0)
    plan = "pagedserve_scheduler_plan_seconds"
    plans = after[plan + "_count"] - before[plan + "_count"]
    return {"constrained": constrained, "concurrency": concurrency,
            "tokens": sum(n for n, _ in outs), "wall_s": wall,
            "tpot_p50_ms": statistics.median(t for _, t in outs) * 1e3,
            "plan_ms_per_step": (after[plan + "_sum"] - before[plan + "_sum"]) / plans * 1e3,
            "bitmask_ms_per_step": mask_s / steps * 1e3 if steps else 0.0,
            "accept_ms_per_step": accept_s / accepts * 1e3 if accepts else 0.0,
            **step_breakdown(before, after, wall)}


def main() -> None:
    from tests.integration.service import Service

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer", default="")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--wide", type=int, default=256, help="second run's running requests")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--server-flag", action="append", default=[])
    args = p.parse_args()
    flags = [*model_flags(args.model, args.load_format, args.tokenizer),
             "--max-num-seqs", str(max(args.concurrency, args.wide)), *args.server_flag]
    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", *flags)
    records = []
    try:
        svc.wait_serving(timeout=600)
        run(svc, True, 8, 32)  # warm-up: kernels, CUDA graphs, the grammar's first compile
        run(svc, False, 8, 32)
        for conc in (args.concurrency, args.wide):
            for constrained in (False, True):
                rec = {"model": Path(args.model).name, "weights": args.load_format,
                       **run(svc, constrained, conc, args.max_tokens)}
                records.append(rec)
                print(f"{conc} running, constrained={constrained}: {rec['tokens']} tokens in "
                      f"{rec['wall_s']:.1f} s; per step {step_split(rec)}", flush=True)
        for conc in dict.fromkeys((args.concurrency, args.wide)):  # (the same twice: newest)
            plain, json_ = [r for r in records if r["concurrency"] == conc][-2:]
            print(f"{conc} running: TPOT {plain['tpot_p50_ms']:.2f} ms plain, "
                  f"{json_['tpot_p50_ms']:.2f} ms JSON schema "
                  f"({json_['tpot_p50_ms'] / plain['tpot_p50_ms'] - 1:+.1%}); per step: bitmask "
                  f"{json_['bitmask_ms_per_step']:.3f} ms (after the plan is sent), accept "
                  f"{json_['accept_ms_per_step']:.3f} ms, planning "
                  f"{json_['plan_ms_per_step']:.3f} ms", flush=True)
    finally:
        svc.stop()
    print("appended to", write_records("structured", records))


if __name__ == "__main__":
    main()
