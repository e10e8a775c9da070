"""benchmarks/prefill_share_sim.py: the real scheduler under a cost model, in simulated time
(deterministic, ~0.1 s a run)."""

from __future__ import annotations

from benchmarks.prefill_share_sim import simulate

# 8 decoders of 64 tokens beside an 8k prompt in 64-token chunks whose attention is slow
SMALL = {"chunk": 64, "budget": 1024, "decoders": 8, "decode_tokens": 64, "prompt": 8192,
         "short_prompt": 16, "decode_ms": 5.0, "attn_tflops": 2.0, "warm_s": 0.5,
         "window_s": 0.5}


def ratio(got: dict, p: str) -> float:
    return got[f"tpot_{p}_during_ms"] / got[f"tpot_{p}_before_ms"]


def test_the_share_holds_the_decoders_near_1_plus_s_and_the_prompt_pays() -> None:
    free = simulate(0.0, **SMALL)
    held = simulate(0.5, **SMALL)
    assert ratio(free, "p50") > 10  # every step carries a chunk at its depth
    # a decoder's steps average (1 + S) plain ones, give or take a chunk the first of which
    # is never held and the restarts' prompts
    assert 1.3 < ratio(held, "p50") < 1.8 and ratio(held, "p90") < 2.0
    assert held["long_ttft_s"] > 1.5 * free["long_ttft_s"]
    assert held["requests_during"] > 100 and held["worst_during"]["tokens"] >= 32
