"""benchmarks/long_context.py on the CPU, at small shapes: both measures are taken and
recorded, and its prefill FLOPs are the ones the roofline bound counts."""

from __future__ import annotations

import json
import re
import sys

import pytest

from benchmarks import long_context
from benchmarks.throughput import roofline_seconds
from pagedserve.executor.config import ModelConfig


def test_prefill_flops_are_the_bounds() -> None:
    cfg = ModelConfig.from_pretrained("benchmarks/models/llama3.1-8b")
    lens = [8192, 8192, 131072]
    assert long_context.prefill_flops(cfg, lens) == roofline_seconds(cfg, lens, [1, 1, 1], 1.0,
                                                                     1e-12)
    # at 128k, attention is most of the work (its pairs grow with the square)
    assert long_context.prefill_flops(cfg, [131072]) > 2 * long_context.prefill_flops(
        cfg, [1]) * 131072


@pytest.mark.slow
def test_a_small_run_records_both_measures(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_RESULTS", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [
        "long_context", "--prompt", "160", "--requests", "1", "--requests", "2",
        "--decoders", "2", "--window-s", "3",  # (1 s saw no gap at nice 19 beside the suite)
        "--server-flag=--max-num-batched-tokens", "--server-flag=64",
        "--server-flag=--long-prefill-token-threshold", "--server-flag=32",
        "--server-flag=--long-prefill-decode-share", "--server-flag=0.5"])
    records = long_context.main()
    prefill = [r for r in records if r["test"] == "prefill"]
    assert [(r["prompt"], r["requests"], len(r["ttft_each_s"])) for r in prefill] == [
        (160, 1, 1), (160, 2, 2)]
    assert all(r["prefill_tflops"] > 0 and r["ttft_s"] > 0 for r in prefill)
    inter = next(r for r in records if r["test"] == "interference")
    assert inter["gaps_before"] > 0 and inter["gaps_during"] > 0  # 5 chunks of 32 beside them
    assert inter["short_ttft_ms"] > 0 and inter["long_ttft_s"] > 0
    assert inter["stagger"] is True and inter["decode_tokens"] == 256
    # where a step's time went before and during: steps ran in both windows
    assert inter["phases_before"]["eager_steps"] + inter["phases_before"]["graph_steps"] > 0
    assert inter["phases_during"]["step_ms"] > 0
    assert inter["phases_during"]["scheduler_loop_ms"]["plan"] > 0
    # the share's log of the prompt's held stretch: its chunks, the first among them
    assert len(inter["share_log"]) >= 1, inter
    assert inter["share_log"][-1].startswith("prefill share 0.50: ")
    assert re.search(r"\b[1-9] steps chunked ", inter["share_log"][-1])
    lines = (tmp_path / "long_context.jsonl").read_text().splitlines()
    assert [json.loads(x)["test"] for x in lines] == ["prefill", "prefill", "interference"]


def test_the_report_gives_a_run_one_row() -> None:
    from benchmarks.report import long_context_section

    base = {"run": "r1", "commit": "c0ffee", "recorded_at": "2026-12-05T00:00:00Z",
            "gpu": "NVIDIA H200", "model": "llama3.1-8b", "kind": "long_context",
            "server_flags": "--long-prefill-token-threshold 2048"}
    recs = [{**base, "test": "prefill", "prompt": 131072, "requests": 1, "ttft_s": 12.04,
             "fraction": 0.771},
            {**base, "test": "interference", "decoders": 64, "tpot_p99_before_ms": 10.2,
             "tpot_p99_during_ms": 71.9, "tpot_p99_ratio": 7.05, "short_ttft_ms": 140.2}]
    newer = {**base, "run": "r2", "server_flags": "--long-prefill-decode-share 0.5"}
    recs += [{**newer, "test": "interference", "decoders": 64, "tpot_p99_before_ms": 6.1,
              "tpot_p99_during_ms": 8.9, "tpot_p99_ratio": 1.46, "itl_p99_before_ms": 9.2,
              "itl_p99_during_ms": 101.0, "itl_p99_ratio": 10.98, "short_ttft_ms": 120.0}]
    rows = [x for x in long_context_section(recs) if x.startswith("| H200")]
    # the older record's tpot_* were ITL percentiles
    assert rows == ["| H200 | llama3.1-8b | 2048 | 1x128k 12.0 s (0.77) | 64: ITL 10.2 -> 71.9 ms "
                    "(x7.05); short TTFT 140 ms | c0ffee | 2026-12-05 00:00 |",
                    "| H200 | llama3.1-8b | 512, share 0.5 | - | 64: TPOT 6.1 -> 8.9 ms (x1.46), "
                    "ITL 9.2 -> 101.0 ms (x10.98); short TTFT 120 ms | c0ffee | 2026-12-05 00:00 |"]


def test_tpot_is_per_stream_over_the_window_and_itl_pools_the_gaps() -> None:
    # two streams; the long prompt arrives at t0 = 10 and prefills until 12
    steady = [(8.0 + 0.1 * i, 1) for i in range(21)]  # 100 ms a token, from 8.0 to 10.0
    slowed = [(8.0, 1), (9.0, 1), (10.0, 1), (10.5, 2), (12.0, 3)]  # a 3-token chunk at the end
    got = long_context.window_stats([steady, slowed], t0=10.0, t1=12.0, window_s=2.0,
                                    min_tokens=1)
    # before: steady 2.0 s / 20 tokens, slowed 2.0 s / 2; ITL pools 20 + 2 gaps
    assert got["tpot_p99_before_ms"] == pytest.approx(1000.0)
    assert got["itl_p50_before_ms"] == pytest.approx(100.0)
    assert got["itl_p99_before_ms"] == pytest.approx(1000.0)
    assert (got["gaps_before"], got["gaps_during"]) == (22, 2)
    # during: only slowed has tokens (10.0 -> 12.0, 5 after the first); gaps 0.25, 0.5
    assert got["tpot_p99_during_ms"] == pytest.approx(400.0)
    assert got["itl_p99_during_ms"] == pytest.approx(500.0)
    assert got["tpot_p99_ratio"] == pytest.approx(0.4)
    assert got["worst_during"] == pytest.approx({"tpot_ms": 400.0, "tokens": 5, "from_s": 0.0,
                                                 "to_s": 2.0, "longest_gap_ms": 500.0,
                                                 "gaps_over_50ms": 2,
                                                 "longest_message_gap_ms": 1500.0,
                                                 "most_tokens_a_message": 3})
    # tokens and messages a quarter second from t0 - 1 = 9.0: steady's 9.0 .. 10.0 and all of
    # slowed's but 8.0; its 2 tokens at 10.5 are one message, its 3 at 12.0 another
    tl = got["timeline"]
    assert (tl["from_s"], tl["bucket_s"], len(tl["tokens"])) == (-1.0, 0.25, 28)
    assert tl["tokens"][:7] == [4, 2, 3, 2, 2, 0, 2]
    assert tl["messages"][:7] == [4, 2, 3, 2, 2, 0, 1]
    assert tl["tokens"][12] == 3 and tl["messages"][12] == 1
    assert (sum(tl["tokens"]), sum(tl["messages"])) == (18, 15)
    # a request's few tokens inside a window (slowed's 2 before t0) are no request's TPOT
    got = long_context.window_stats([steady, slowed], t0=10.0, t1=12.0, window_s=2.0,
                                    min_tokens=3)
    assert got["tpot_p99_before_ms"] == pytest.approx(100.0)
    assert got["tpot_p99_during_ms"] == pytest.approx(400.0)  # slowed's 5 during count


def test_staggered_decoders_start_over_at_evenly_spread_steps() -> None:
    firsts = [long_context.first_tokens(i, 64, 256, True) for i in range(64)]
    assert firsts[:4] == [16, 16, 16, 16] and firsts[4:6] == [20, 24] and firsts[-1] == 256
    assert [long_context.first_tokens(i, 64, 256, False) for i in (0, 63)] == [256, 256]
    assert long_context.first_tokens(0, 4, 8, True) == 8  # never past a request's tokens
    assert long_context.first_tokens(3, 4, 0, True) == 0  # one request, as long as allowed
