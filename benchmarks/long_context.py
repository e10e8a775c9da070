"""Long context (docs/performance.md, "Long context"): how fast long prompts prefill, and what
they do to the requests around them. Prefix caching is off, so nothing is reused.

Two measures, each against a fresh `pagedserve serve` with the given flags:

- **prefill** (`--prompt N --requests R`, repeatable): R prompts of N random tokens sent at
  once, one output token each. TTFT of each; the batch's prefill rate is its FLOPs over the
  last first token's time, FLOPs counted as the bound counts them (2 x active parameters a
  token, the LM head once a request, 4 x layers x heads x head_dim per causal (query, key)
  pair). On a GPU the record also holds the roofline bound of the same batch
  (benchmarks/throughput.py) and the fraction reached.
- **interference** (`--decoders D`): D short streams decode (128-token prompts); their tokens
  are timed for `--window-s` before one long prompt (the largest --prompt) arrives, and while
  it prefills; midway through that prefill (at half its TTFT in the prefill measure) a short
  request arrives, and its TTFT is taken. Each stream's TPOT in a window is its time from the
  first token in it to the last over the tokens after the first (../shared/BENCHMARKS.md's
  TPOT, over the window); p50 / p99 over the streams before and during, and their ratio
  (issue 32's goal: p99 during within 1.5x of before). ITL p50 / p99 pool every gap between
  streamed chunks (a step that carries a chunk shows there even where TPOT absorbs it).
  Records before 2026-12-05 named the ITL percentiles tpot_*.

The long prompt is prefilled in chunks of at most `--long-prefill-token-threshold` tokens a step
(512 by default): pass it with --server-flag to measure other chunk sizes.

    python -m benchmarks.long_context --model benchmarks/models/llama3.1-8b \\
        --load-format random --tokenizer benchmarks/models/smollm2-135m \\
        --prompt 8192 --prompt 32768 --prompt 131072 --requests 1 --requests 4 --decoders 64
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    AboveTheBound,
    model_flags,
    step_breakdown,
    step_split,
    write_records,
)
from benchmarks.throughput import (
    PROMPT_VOCAB,
    _send_all,
    bound_basis,
    ceilings,
    roofline_seconds,
    tensor_parallel_size,
    warmup_prompts,
    weight_params,
)

SHORT_PROMPT = 128  # the decoders' and the mid-prefill request's prompt length


def prefill_flops(cfg, prompt_lens: list[int]) -> float:
    """A batch of prompts' prefill FLOPs as the bound counts them."""
    params = weight_params(cfg)
    p = np.asarray(prompt_lens, np.float64)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return float(2 * (params.active() - params.head) * p.sum() + 2 * params.head * len(p)
                 + attn * (p * (p + 1) / 2).sum())


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, PROMPT_VOCAB, length).tolist() for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def interference(address: str, decoders: int, long_prompt: list[int], window_s: float,
                       short_after_s: float, max_model_len: int, decode_tokens: int,
                       scrape=None, stagger: bool = True) -> dict:
    """Per-token gaps of `decoders` streams before and while the long prompt prefills, and the
    TTFT of a short request sent `short_after_s` into that prefill. With `scrape` (the
    service's metrics), where a step's time went in the window before and during the prefill
    (common.step_breakdown: `phases_before`, `phases_during`).

    Each decoder generates `decode_tokens` tokens and starts over with a fresh prompt (0: one
    request as long as the model allows), so its context, and a plain decode step's cost,
    stays the same before and during the prefill: a request growing through a 45 s prefill
    reads ~6x the KV it read before it, which the comparison would count against the
    prefill. With `stagger`, decoder i's first request is (i + 1) / decoders of decode_tokens
    long (at least STAGGER_MIN), so the streams start over at evenly spread steps, a fresh
    prompt every few steps, in both windows alike; without it they start over all in the same
    step before the prompt (their restart prefill in nobody's TPOT), while during the prefill
    the chunks split that cohort and its restart prefill lands in steps the others decode in
    (H100, f8340c5: held steps averaged 8.9 ms where profiled graphed ones took 7.0-7.2)."""
    import grpc

    from pagedserve.protos.v1 import generate_pb2 as api
    from pagedserve.protos.v1 import generate_pb2_grpc

    def request(ids: list[int], max_tokens: int) -> api.GenerateRequest:
        return api.GenerateRequest(token_ids=api.TokenIds(ids=ids), sampling=api.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    # one list per stream; a decoder's next request appends a list of its own (a gap across
    # two requests is a TTFT, not a token's)
    stamps: list[list[tuple[float, int]]] = [[] for _ in range(decoders)]

    async def decode(stub, i: int, ids: list[int]) -> None:
        mine, rounds = stamps[i], 0
        while True:
            n = (decode_tokens or max_model_len - len(ids)) if rounds else \
                first_tokens(i, decoders, decode_tokens, stagger) or max_model_len - len(ids)
            async for chunk in stub.Generate(request(ids, n), timeout=3600):
                mine.append((time.perf_counter(), len(chunk.token_ids)))
            if not decode_tokens:
                return
            rounds += 1
            ids = random_prompts(1, SHORT_PROMPT, seed=1000 * rounds + i)[0]
            mine = []
            stamps.append(mine)

    async def first_token(stub, ids: list[int]) -> float:
        sent = time.perf_counter()
        async for _ in stub.Generate(request(ids, 1), timeout=3600):
            return time.perf_counter() - sent
        raise RuntimeError("no token came")

    prompts = random_prompts(decoders + 1, SHORT_PROMPT, seed=7)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(decode(stub, i, p)) for i, p in enumerate(prompts[:-1])]
        while min(len(s) for s in stamps[:decoders]) < 4:  # every stream past its prefill
            if failed := [t for t in tasks if t.done()]:
                await failed[0]  # (its error; a stream does not end this early)
                raise RuntimeError("a decoding stream ended before the measure")
            await asyncio.sleep(0.05)
        scraped = []

        async def mark() -> None:  # (off the event loop: the streams' stamps go on)
            if scrape is not None:
                scraped.append((await asyncio.to_thread(scrape), time.perf_counter()))

        await mark()
        await asyncio.sleep(window_s)
        await mark()
        t0 = time.perf_counter()
        long_task = asyncio.create_task(first_token(stub, long_prompt))
        await asyncio.sleep(short_after_s)
        short_ttft = await first_token(stub, prompts[-1])
        long_ttft = await long_task
        t1 = t0 + long_ttft
        await mark()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    phases = {}
    if scraped:
        (m0, s0), (m1, s1), (m2, s2) = scraped
        phases = {"phases_before": step_breakdown(m0, m1, s1 - s0),
                  "phases_during": step_breakdown(m1, m2, s2 - s1)}
    return {"long_ttft_s": long_ttft, "short_ttft_ms": 1e3 * short_ttft,
            "short_sent_after_s": short_after_s, **window_stats(stamps, t0, t1, window_s),
            **phases}


MIN_TPOT_TOKENS = 32  # a request's tokens inside a window for its TPOT there to count
STAGGER_MIN = 16  # the shortest first request of a staggered decoder (the start waits for 4)


def first_tokens(i: int, decoders: int, decode_tokens: int, stagger: bool) -> int:
    """Decoder i's first request's tokens (0: as long as the model allows)."""
    if not stagger or not decode_tokens:
        return decode_tokens
    return max(min(STAGGER_MIN, decode_tokens), decode_tokens * (i + 1) // decoders)


def window_stats(stamps: list[list[tuple[float, int]]], t0: float, t1: float,
                 window_s: float, min_tokens: int = MIN_TPOT_TOKENS) -> dict:
    """TPOT (per request, over its tokens inside each window) and ITL (every gap, pooled)
    percentiles before [t0 - window_s, t0] and during [t0, t1], from each request's
    (arrival, tokens) chunks. A request with fewer than min_tokens tokens inside a window
    (after its first there) gives no TPOT there: the last few tokens of a request begun
    before the window are no request's TPOT (their gaps still count in the ITL)."""
    out = {}
    for name, lo, hi in (("before", t0 - window_s, t0), ("during", t0, t1)):
        gaps, tpots, worst = [], [], None
        for s in stamps:
            inside = [(at, n) for at, n in s if lo <= at <= hi]
            mine = [(at - prev) / max(n, 1)
                    for (prev, _), (at, n) in zip(inside, inside[1:], strict=False)]
            gaps += mine
            after_first = sum(n for _, n in inside[1:])
            if after_first >= min_tokens:
                tpots.append((inside[-1][0] - inside[0][0]) / after_first)
                if worst is None or tpots[-1] > worst[0]:
                    worst = (tpots[-1], inside, mine)
        out.update({f"tpot_p50_{name}_ms": 1e3 * percentile(tpots, 0.5),
                    f"tpot_p90_{name}_ms": 1e3 * percentile(tpots, 0.9),
                    f"tpot_p99_{name}_ms": 1e3 * percentile(tpots, 0.99),
                    f"itl_p50_{name}_ms": 1e3 * percentile(gaps, 0.5),
                    f"itl_p99_{name}_ms": 1e3 * percentile(gaps, 0.99),
                    f"gaps_{name}": len(gaps), f"requests_{name}": len(tpots)})
        if worst is not None:  # what made the slowest request slow: many stalls, or one
            tpot, inside, mine = worst
            out[f"worst_{name}"] = {
                "tpot_ms": 1e3 * tpot, "tokens": sum(n for _, n in inside[1:]),
                "from_s": inside[0][0] - t0, "to_s": inside[-1][0] - t0,
                "longest_gap_ms": 1e3 * max(mine, default=0.0),
                "gaps_over_50ms": sum(g > 0.05 for g in mine),
                # a gap above is per token: a message carrying several tokens after a stall
                # (streams coalesce under backpressure) shows here whole
                "longest_message_gap_ms": 1e3 * max(
                    (b - a for (a, _), (b, _) in zip(inside, inside[1:], strict=False)),
                    default=0.0),
                "most_tokens_a_message": max((n for _, n in inside), default=0)}
    out["timeline"] = timeline(stamps, t0)
    for m in ("tpot", "itl"):
        out[f"{m}_p99_ratio"] = out[f"{m}_p99_during_ms"] / out[f"{m}_p99_before_ms"]
    return out


def timeline(stamps: list[list[tuple[float, int]]], t0: float, lo_s: float = -1.0,
             hi_s: float = 6.0, bucket_s: float = 0.25) -> dict:
    """Tokens every stream received in each bucket_s from lo_s to hi_s around t0, and the
    messages that carried them: whether the engine slowed (fewer tokens) or their delivery
    did (as many tokens, in fewer, larger messages)."""
    n = round((hi_s - lo_s) / bucket_s)
    tokens, messages = [0] * n, [0] * n
    for s in stamps:
        for at, k in s:
            if 0 <= (i := int((at - t0 - lo_s) // bucket_s)) < n:
                tokens[i] += k
                messages[i] += 1
    return {"from_s": lo_s, "bucket_s": bucket_s, "tokens": tokens, "messages": messages}


def main() -> list[dict]:
    from pagedserve.core.models import resolve_model
    from pagedserve.executor.config import ModelConfig
    from tests.integration.service import Service

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", default="auto", choices=["auto", "random"])
    p.add_argument("--tokenizer", default="")
    p.add_argument("--prompt", type=int, action="append", default=[])
    p.add_argument("--requests", type=int, action="append", default=[])
    p.add_argument("--decoders", type=int, default=64, help="0: no interference measure")
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--decode-tokens", type=int, default=256,
                   help="a decoder's tokens a request, then a fresh one (0: one request, as "
                        "long as the model allows, its context growing)")
    p.add_argument("--stagger", action=argparse.BooleanOptionalAction, default=True,
                   help="spread the decoders' fresh requests evenly over the steps (default); "
                        "--no-stagger: they all start over in the same step (records with no "
                        "`stagger` field ran so)")
    p.add_argument("--server-flag", action="append", default=[])
    args = p.parse_args()
    lengths = args.prompt or [8192, 32768, 131072]
    counts = args.requests or [1, 4]
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(model_dir)
    longest = max(lengths)
    max_len = max(longest, 1024) + 16  # (room for the decoders to run through the measure)
    flags = [*model_flags(args.model, args.load_format, args.tokenizer),
             "--no-enable-prefix-caching", "--max-model-len", str(max_len),
             "--max-num-seqs", str(max(256, args.decoders + 8)), *args.server_flag]
    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", *flags)
    records, ttft_of = [], {}
    try:
        svc.wait_serving(timeout=900)
        info = svc.client.model_info()
        on_gpu = info.device != "cpu"
        tp = tensor_parallel_size(args.server_flag)
        common = {"model": Path(str(model_dir)).name, "weights": args.load_format,
                  "device": info.device, "dtype": info.dtype,
                  "server_flags": " ".join(args.server_flag)}
        ceil = ceilings("cuda") if on_gpu else {}
        basis = {}
        if on_gpu:
            weight = svc.metrics().get("pagedserve_model_weight_bytes", 0)
            basis = bound_basis(cfg, tp * weight, info.kv_cache_dtype)
        # the same warm-up shapes, other ids (nothing is cached anyway)
        asyncio.run(_send_all(svc.address, warmup_prompts([[0] * min(lengths)]), [4]))
        for n in lengths:
            for r in counts:
                prompts = random_prompts(r, n, seed=n * 10 + r)
                lat, wall = asyncio.run(_send_all(svc.address, prompts, [1] * r))
                ttfts = [t for t, _ in lat]
                flops = prefill_flops(cfg, [n] * r)
                rec = {**common, "kind": "long_context", "test": "prefill", "prompt": n,
                       "requests": r, "ttft_s": max(ttfts), "ttft_each_s": ttfts,
                       "prefill_tflops": flops / max(ttfts) / 1e12}
                if on_gpu:
                    bound = roofline_seconds(cfg, [n] * r, [1] * r, tp * ceil["copy_tbps"],
                                             tp * ceil["gemm_tflops"],
                                             basis["bound_weight_bytes_per_param"],
                                             basis["bound_kv_bytes"])
                    rec.update(ceil, **basis, bound_s=bound, fraction=bound / max(ttfts))
                    if rec["fraction"] > 1:  # work skipped (a cached prefix): never a record
                        raise AboveTheBound(f"prefill {r} x {n}: {max(ttfts):.3f} s is below "
                                            f"its bound {bound:.3f} s ({basis})")
                if r == 1:
                    ttft_of[n] = max(ttfts)
                records.append(rec)
                print(f"prefill {r} x {n}: TTFT {max(ttfts):.2f} s, "
                      f"{rec['prefill_tflops']:.1f} TFLOP/s"
                      + (f", {rec['fraction']:.2f} of the bound" if on_gpu else ""), flush=True)
        if args.decoders:
            long_prompt = random_prompts(1, longest, seed=99)[0]
            got = asyncio.run(interference(svc.address, args.decoders, long_prompt,
                                           args.window_s, ttft_of.get(longest, 1.0) / 2,
                                           max_len, args.decode_tokens, svc.metrics,
                                           args.stagger))
            # the decoders' share logs what each stretch of held prefill's steps took
            time.sleep(1.0)
            share_log = [line.split(": ", 1)[1].strip()
                         for line in svc.log_path.read_text().splitlines()
                         if "scheduler: prefill share " in line]
            records.append({**common, "kind": "long_context", "test": "interference",
                            "prompt": longest, "decoders": args.decoders,
                            "decode_tokens": args.decode_tokens, "stagger": args.stagger,
                            "short_prompt": SHORT_PROMPT, **got,
                            **({"share_log": share_log} if share_log else {})})
            print(f"{args.decoders} decoders, a {longest}-token prompt arriving: TPOT p99 "
                  f"{got['tpot_p99_before_ms']:.1f} -> {got['tpot_p99_during_ms']:.1f} ms "
                  f"(x{got['tpot_p99_ratio']:.2f}), p50 {got['tpot_p50_before_ms']:.1f} -> "
                  f"{got['tpot_p50_during_ms']:.1f}; ITL p99 {got['itl_p99_before_ms']:.1f} "
                  f"-> {got['itl_p99_during_ms']:.1f}; a short request's TTFT mid-prefill "
                  f"{got['short_ttft_ms']:.0f} ms (the long one's {got['long_ttft_s']:.2f} s)",
                  flush=True)
            if w := got.get("worst_during"):
                print(f"  the slowest request during: TPOT {w['tpot_ms']:.1f} ms over "
                      f"{w['tokens']} tokens ({w['from_s']:.1f}-{w['to_s']:.1f} s into the "
                      f"prefill), longest gap {w['longest_gap_ms']:.0f} ms, "
                      f"{w['gaps_over_50ms']} gaps over 50 ms (the longest message gap "
                      f"{w['longest_message_gap_ms']:.0f} ms, at most "
                      f"{w['most_tokens_a_message']} tokens a message)", flush=True)
            for line in share_log:
                print(f"  {line}", flush=True)
            for when in ("before", "during"):
                print(f"  a step {when}: {step_split(got[f'phases_{when}'])}", flush=True)
            tl = got["timeline"]
            print(f"  tokens (messages) a {tl['bucket_s']} s from {tl['from_s']} s: " + " ".join(
                f"{k}({m})" for k, m in zip(tl["tokens"], tl["messages"], strict=True)),
                flush=True)
    finally:
        svc.stop()
    print(write_records("long_context", records))
    return records


if __name__ == "__main__":
    main()
