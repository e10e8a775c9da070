"""Serving benchmark (W3 of ../shared/BENCHMARKS.md) through the real gRPC API.

Requests arrive as a Poisson process at --rate requests/s ("inf": all at t=0); prompt and output
lengths follow a ShareGPT-like shape (log-normal, mean about 200 prompt and 180 output tokens,
clipped to [4, 1024]); prompts are random token ids, EOS ignored so lengths are exact. Metrics as
vLLM's `bench serve` defines them: TTFT, TPOT, ITL, E2EL (mean, p50, p99), output throughput,
goodput under an SLO.

Variants:
  --shared-prefix N         every prompt starts with the same N tokens (a system prompt); run
                            with and without --server-flag=--no-enable-prefix-caching
  --high-priority-fraction  that share of requests gets priority 0, the rest 10; TTFT per class

    python -m benchmarks.serve --model benchmarks/models/smollm2-135m --load-format random \\
        --rate 8 --rate inf --num-requests 1000
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from benchmarks.common import model_flags, step_bounds, step_breakdown, write_records
from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2_grpc


@dataclass
class Outcome:
    priority: int
    prompt_len: int
    output_len: int
    sent_at: float = 0.0  # seconds since the run started
    ttft: float = math.nan
    e2el: float = math.nan
    itls: list[float] = field(default_factory=list)
    error: str = ""


def sharegpt_like(n: int, seed: int, prefix: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    # a prompt's own part stays within 1024 tokens with the prefix, but never below 128 (a
    # long shared prefix would leave nothing of its own to prefill)
    prompts = np.clip(rng.lognormal(np.log(150), 0.8, n), 4, max(1024 - prefix, 128)).astype(int)
    outputs = np.clip(rng.lognormal(np.log(135), 0.8, n), 4, 1024).astype(int)
    return list(zip(prompts.tolist(), outputs.tolist(), strict=True))


async def one(stub, ids: list[int], out: Outcome, timeout: float) -> None:
    req = build_request(token_ids=ids, max_tokens=out.output_len, temperature=0,
                        ignore_eos=True, priority=out.priority)
    sent = last = time.perf_counter()
    try:
        async for chunk in stub.Generate(req, timeout=timeout):
            now = time.perf_counter()
            if math.isnan(out.ttft):
                out.ttft = now - sent
            else:
                out.itls.append(now - last)
            last = now
            del chunk
        out.e2el = last - sent
    except grpc.aio.AioRpcError as e:
        out.error = e.code().name


async def drive(address: str, rate: float, shapes: list[tuple[int, int]], prefix: list[int],
                high_fraction: float, vocab: int, seed: int, timeout: float):
    rng = np.random.default_rng(seed + 1)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        outcomes, tasks = [], []
        start = time.perf_counter()
        for prompt_len, output_len in shapes:
            if rate != math.inf:
                await asyncio.sleep(rng.exponential(1.0 / rate))
            priority = 0 if rng.random() < high_fraction else 10
            ids = prefix + rng.integers(100, vocab, prompt_len).tolist()
            out = Outcome(priority, len(ids), output_len, time.perf_counter() - start)
            outcomes.append(out)
            tasks.append(asyncio.create_task(one(stub, ids, out, timeout)))
        await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else math.nan


def summarize(outcomes: list[Outcome], wall: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [o for o in outcomes if not o.error]
    ttft = [o.ttft for o in ok]
    tpot = [(o.e2el - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itl = [x for o in ok for x in o.itls]
    e2el = [o.e2el for o in ok]
    good = sum(1 for o in ok if o.ttft <= slo_ttft and (
        o.output_len <= 1 or (o.e2el - o.ttft) / (o.output_len - 1) <= slo_tpot))
    out_tokens = sum(o.output_len for o in ok)
    rec = {"completed": len(ok), "refused": sum(o.error == "RESOURCE_EXHAUSTED" for o in outcomes),
           "failed": sum(bool(o.error) and o.error != "RESOURCE_EXHAUSTED" for o in outcomes),
           "wall_s": wall, "output_tok_s": out_tokens / wall,
           "total_tok_s": (out_tokens + sum(o.prompt_len for o in ok)) / wall,
           "request_rps": len(ok) / wall, "goodput_rps": good / wall,
           "slo_ttft_ms": slo_ttft * 1e3, "slo_tpot_ms": slo_tpot * 1e3}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        rec[f"{name}_mean_ms"] = statistics.fmean(xs) * 1e3 if xs else math.nan
        rec[f"{name}_p50_ms"] = pct(xs, 50)
        rec[f"{name}_p99_ms"] = pct(xs, 99)
    return rec


def by_priority(outcomes: list[Outcome]) -> dict[str, dict]:
    classes = {"high": [o for o in outcomes if o.priority == 0],
               "low": [o for o in outcomes if o.priority != 0]}
    res = {}
    for name, group in classes.items():
        ok = [o.ttft for o in group if not o.error]
        res[name] = {"requests": len(group), "completed": len(ok),
                     "refused": sum(o.error == "RESOURCE_EXHAUSTED" for o in group),
                     "ttft_p50_ms": pct(ok, 50), "ttft_p99_ms": pct(ok, 99)}
    return res


def dump(folder: Path, rate: str, outcomes: list[Outcome], svc) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"requests_rate{rate}.csv").open("w") as f:
        f.write("sent_at_s,priority,prompt_len,output_len,ttft_ms,e2el_ms,error\n")
        for o in outcomes:
            f.write(f"{o.sent_at:.4f},{o.priority},{o.prompt_len},{o.output_len},"
                    f"{o.ttft * 1e3:.1f},{o.e2el * 1e3:.1f},{o.error}\n")
    metrics = svc.metrics()
    (folder / f"metrics_rate{rate}.txt").write_text(
        "\n".join(f"{k} {v}" for k, v in sorted(metrics.items()) if "bucket" not in k))


def main() -> None:
    from transformers import AutoConfig

    from pagedserve.core.models import resolve_model
    from tests.integration.service import Service

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer", default="", help="tokenizer directory (config-only models)")
    p.add_argument("--rate", action="append", default=[], help="req/s or inf (repeatable)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("--high-priority-fraction", type=float, default=0.0)
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra flag for pagedserve serve (repeatable, e.g. "
                        "--server-flag=--no-enable-prefix-caching)")
    p.add_argument("--workload", default="W3")
    p.add_argument("--slo-ttft-ms", type=float, default=250)
    p.add_argument("--slo-tpot-ms", type=float, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", help="write per-request outcomes (CSV) and the final /metrics here")
    p.add_argument("--overload", type=float, default=0.0,
                   help="first measure capacity (completed req/s) at the first --rate, then run "
                        "at this multiple of it")
    args = p.parse_args()
    vocab = AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size
    rng = np.random.default_rng(args.seed + 7)
    prefix = rng.integers(100, vocab, args.shared_prefix).tolist()
    shapes = sharegpt_like(args.num_requests, args.seed, args.shared_prefix)
    flags = [*model_flags(args.model, args.load_format, args.tokenizer), *args.server_flag]
    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", *flags)
    records = []
    try:
        svc.wait_serving(timeout=600)
        # warm-up: kernels compile on first use of each shape class (measured: ~8 s of TTFT
        # for the first requests of a cold run); a long-running server has paid this already
        asyncio.run(drive(svc.address, math.inf, sharegpt_like(8, args.seed + 99,
                                                               args.shared_prefix),
                          prefix, 0.0, vocab, args.seed + 99, timeout=600))
        rates = args.rate or ["inf"]
        if args.overload:  # capacity = completions/s at the first --rate (a paced run above
            rates = [rates[0], "overload"]  # capacity measures it; a burst at inf does not)
        for rate_s in rates:
            if rate_s == "overload":  # a multiple of the capacity just measured
                rate_s = f"{args.overload * records[0]['request_rps']:.2f}"
            rate = math.inf if rate_s == "inf" else float(rate_s)
            before = svc.metrics()
            outcomes, wall = asyncio.run(drive(svc.address, rate, shapes, prefix,
                                               args.high_priority_fraction, vocab, args.seed,
                                               timeout=3600))
            after = svc.metrics()
            rec = {"workload": args.workload, "model": Path(args.model).name,
                   "weights": args.load_format, "engine": "pagedserve", "rate": rate_s,
                   "num_requests": args.num_requests, "shared_prefix": args.shared_prefix,
                   "server_flags": " ".join(args.server_flag),
                   **summarize(outcomes, wall, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3),
                   **step_breakdown(before, after, wall),
                   **step_bounds(svc.log_path.read_text(errors="replace"))}
            if args.shared_prefix:
                rec["prefix_caching"] = "off" if "--no-enable-prefix-caching" in \
                    args.server_flag else "on"
            records.append(rec)
            if args.high_priority_fraction:
                for cls, stats in by_priority(outcomes).items():
                    records.append({**rec, "priority": cls, **stats})
            print(f"rate {rate_s}: {rec['output_tok_s']:.0f} out tok/s, "
                  f"{rec['request_rps']:.2f} req/s, TTFT p50/p99 {rec['ttft_p50_ms']:.0f}/"
                  f"{rec['ttft_p99_ms']:.0f} ms, TPOT p50/p99 {rec['tpot_p50_ms']:.1f}/"
                  f"{rec['tpot_p99_ms']:.1f} ms, goodput {rec['goodput_rps']:.2f} req/s, "
                  f"refused {rec['refused']}", flush=True)
            if args.high_priority_fraction:
                for cls, stats in by_priority(outcomes).items():
                    print(f"  {cls}: {stats}", flush=True)
            if args.dump:
                dump(Path(args.dump), rate_s, outcomes, svc)
    finally:
        svc.stop()
    print("appended to", write_records("serve", records))


if __name__ == "__main__":
    main()
