"""The decoders' share (--long-prefill-decode-share) in simulation: the real Scheduler and
PrefillShare, a cost model of the device in place of the executor, simulated time.

    python -m benchmarks.prefill_share_sim [--share 0.5] [--chunk 512] [--budget 8192]
        [--decoders 64] [--decode-tokens 256] [--prompt 131072] [--no-stagger]

Each step takes a plain decode step's time (--decode-ms, 7.2: the 8B's 64 decoders on an
H100) plus its prefill tokens' GEMMs (--gemm-us a token) and their causal attention at their
depth (4 x layers x q heads x head_dim FLOPs a query-key pair, at --attn-tflops). Decoders
generate --decode-tokens each and start over with a fresh --short-prompt, their first requests
staggered (--no-stagger: all in one step), as benchmarks/long_context.py's do; the long prompt
arrives after --warm-s and the windows' statistics are long_context.window_stats's. What it
leaves out is what a GPU run adds beside the scheduler's choices (host stalls, the executor,
streaming): on the H100 at 151eb00 the model gave the prompt's TTFT 41.3 s against 40.8
measured and TPOT p50 10.7 ms against 11.3, but TPOT p99 11.3 against 35.8. Staggered, at
4c00774: TPOT p99 x1.35 at share 0.3 and x1.47 at 0.4 against the H100's x1.40 and x1.52, the
prompt's TTFT 56.6 and 46.3 s against 51.6 and 44.5."""

from __future__ import annotations

import argparse

from benchmarks.long_context import first_tokens, window_stats
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.request import GenerationParams, Request
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig


def simulate(share: float, chunk: int, budget: int, decoders: int, decode_tokens: int,
             prompt: int, short_prompt: int = 128, decode_ms: float = 7.2, gemm_us: float = 23.0,
             attn_tflops: float = 480.0, attn_flops_per_pair: int = 4 * 32 * 4096,
             warm_s: float = 5.0, window_s: float = 3.0, slow_during: float = 1.0,
             stagger: bool = True) -> dict:
    """window_stats of the decoders before and during the long prompt's prefill, with its
    TTFT (`long_ttft_s`), all in simulated seconds."""
    cfg = SchedulerConfig(max_num_seqs=max(256, decoders + 1), max_num_batched_tokens=budget,
                          long_prefill_token_threshold=chunk, long_prefill_decode_share=share,
                          enable_prefix_caching=False)
    blocks = (prompt + 2 * decoders * (short_prompt + decode_tokens)) // 16 + 64
    sched = Scheduler(cfg, BlockManager(blocks, 16, 0, False))
    ids = iter(range(1, 1 << 30))

    def add(length: int, max_tokens: int) -> Request:
        rid = next(ids)
        r = Request(rid, f"r{rid}", length, [100 + (rid * 7 + i) % 30000 for i in range(length)],
                    GenerationParams(max_tokens=max_tokens, ignore_eos=True), arrival_seq=rid)
        sched.add(r)
        return r

    def seconds(out) -> float:
        t = decode_ms / 1e3 * (slow_during if t0 is not None else 1.0)
        for x in out.scheduled():
            if x.num_tokens > 1:  # a prompt's (or chunk's) tokens at their depth
                t += x.num_tokens * gemm_us / 1e6
                t += (attn_flops_per_pair * x.num_tokens * (x.start + x.num_tokens / 2)
                      / (attn_tflops * 1e12))
        return t

    for i in range(decoders):
        add(short_prompt, first_tokens(i, decoders, decode_tokens, stagger))
    stamps: dict[int, list[tuple[float, int]]] = {}
    now, t0, t1, long_id = 0.0, None, None, None
    while t1 is None:
        out = sched.schedule()
        took = seconds(out)
        now += took
        done = [x.req.req_id for x in out.scheduled()
                if x.req.num_computed_tokens == x.req.num_tokens]
        sampled = sched.update(done, [7] * len(done))
        if sched.prefill_share is not None:
            sched.prefill_share.observe(took, decoding=out.decoding, chunked=out.chunked,
                                        held=out.held_chunks > 0)
        for sm in sampled:
            if sm.req.req_id == long_id:
                t1 = now
                continue
            stamps.setdefault(sm.req.req_id, []).append((now, 1))
            if sm.finish_reason is not None:
                add(short_prompt, decode_tokens)
        if t0 is None and now >= warm_s:
            t0, long_id = now, add(prompt, 1).req_id
    return {"long_ttft_s": t1 - t0, **window_stats(list(stamps.values()), t0, t1, window_s)}


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=float, default=0.5)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--decoders", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--prompt", type=int, default=131072)
    p.add_argument("--decode-ms", type=float, default=7.2)
    p.add_argument("--attn-tflops", type=float, default=480.0)
    p.add_argument("--slow-during", type=float, default=1.0,
                   help="every step's decode part this much slower while the prompt prefills "
                        "(1.22: the plain steps' 7.3 -> 8.9 ms on an H100 at d96218f)")
    p.add_argument("--stagger", action=argparse.BooleanOptionalAction, default=True,
                   help="the decoders' first requests staggered (long_context's default)")
    a = p.parse_args()
    got = simulate(a.share, a.chunk, a.budget, a.decoders, a.decode_tokens, a.prompt,
                   decode_ms=a.decode_ms, attn_tflops=a.attn_tflops, slow_during=a.slow_during,
                   stagger=a.stagger)
    print(f"share {a.share}, chunk {a.chunk}: the prompt's TTFT {got['long_ttft_s']:.1f} s; "
          + "; ".join(f"{m} {got[f'{m}_before_ms']:.1f} -> {got[f'{m}_during_ms']:.1f} ms"
                      for m in ("tpot_p50", "tpot_p90", "tpot_p99", "itl_p99")))
    return got


if __name__ == "__main__":
    main()
