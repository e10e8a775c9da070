"""The cost of the OpenAI-compatible HTTP API against gRPC, on the CPU default model (not in CI).

One `pagedserve serve`; --streams concurrent streams sent at once (the same text prompts, seeds and
max_tokens, ignore_eos, so every request generates exactly max_tokens) through gRPC, then through
HTTP (POST /v1/completions, stream: true, read as server-sent events), alternating for --rounds
rounds, with the prefix cache off (each burst prefills the same prompts). Reports output tokens/s,
TTFT, end-to-end latency and the CPU seconds of scheduler, executor and client per API and round,
and the HTTP/gRPC throughput ratio; appends one record to benchmarks/results/http.jsonl.

    python -m benchmarks.http_vs_grpc --streams 256 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import httpx2

from benchmarks.common import write_records
from benchmarks.load import Outcome, one, summary, text_prompt
from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2_grpc


def prompts(streams: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [text_prompt(rng, rng.randint(4, 200)) for _ in range(streams)]


async def grpc_burst(address: str, texts: list[str], max_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        reqs = [build_request(text=t, max_tokens=max_tokens, temperature=0.8, seed=i,
                              ignore_eos=True) for i, t in enumerate(texts)]
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(stub, r, timeout=3600) for r in reqs))
        return summary(outcomes, time.perf_counter() - start)


async def http_one(client: httpx2.AsyncClient, url: str, body: dict) -> Outcome:
    out = Outcome()
    sent = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.status = f"HTTP_{resp.status_code}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    out.status = chunk["error"]["code"] or "ERROR"
                    return out
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                    continue
                if math.isnan(out.ttft):
                    out.ttft = now - sent
                else:
                    out.max_gap = max(out.max_gap, now - last)
                last = now
        out.e2el = last - sent
    except httpx2.HTTPError as e:
        out.status = type(e).__name__
    return out


async def http_burst(base: str, texts: list[str], max_tokens: int) -> dict:
    limits = httpx2.Limits(max_connections=len(texts), max_keepalive_connections=len(texts))
    async with httpx2.AsyncClient(limits=limits, timeout=None) as client:
        bodies = [{"model": "default", "prompt": t, "max_tokens": max_tokens,
                   "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}} for i, t in enumerate(texts)]
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(http_one(client, base + "/v1/completions", b)
                                          for b in bodies))
        return summary(outcomes, time.perf_counter() - start)


def cpu_seconds(procs: dict) -> dict[str, float]:
    """CPU time so far of the server's processes and of this client (where the cost lands)."""
    out = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    out["client"] = time.process_time()
    return out


def main() -> None:
    import psutil

    from tests.integration.service import Service

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="gRPC then HTTP, this many times")
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra flag for pagedserve serve (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # no prefix cache: every burst sends the same prompts, and a later one would skip their
    # prefill, favouring whichever API goes second
    flags = ["--max-num-seqs", str(args.streams), "--no-enable-prefix-caching",
             *args.server_flag]
    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", *flags)
    texts = prompts(args.streams, args.seed)
    rec: dict = {"model": "default", "cpu_count": psutil.cpu_count(), "streams": args.streams,
                 "max_tokens": args.max_tokens, "server_flags": " ".join(flags),
                 "grpc": [], "http": []}
    try:
        svc.wait_serving(timeout=600)
        children = psutil.Process(svc.proc.pid).children()
        procs = {name: next(c for c in children if name in c.cmdline())
                 for name in ("scheduler", "executor")}
        asyncio.run(grpc_burst(svc.address, texts[:8], 4))  # warm both paths once
        asyncio.run(http_burst(svc.http_url, texts[:8], 4))
        for _ in range(args.rounds):
            for api, run in (("grpc", lambda: grpc_burst(svc.address, texts, args.max_tokens)),
                             ("http", lambda: http_burst(svc.http_url, texts,
                                                         args.max_tokens))):
                before = cpu_seconds(procs)
                result = asyncio.run(run())
                after = cpu_seconds(procs)
                result["cpu_s"] = {k: round(after[k] - before[k], 1) for k in after}
                svc.wait_idle(timeout=60)
                rec[api].append(result)
                print(api, json.dumps(result), flush=True)
    finally:
        svc.stop()
    mean = {api: statistics.mean(r["output_tok_s"] for r in rec[api]) for api in ("grpc", "http")}
    rec["output_tok_s_mean"] = {k: round(v, 1) for k, v in mean.items()}
    rec["http_over_grpc"] = round(mean["http"] / mean["grpc"], 3)
    print("mean output tok/s", rec["output_tok_s_mean"], "http/grpc", rec["http_over_grpc"])
    print("appended to", write_records("http", [rec]))


if __name__ == "__main__":
    main()
