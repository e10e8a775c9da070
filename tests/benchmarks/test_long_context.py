"""benchmarks/long_context.py on the CPU, at small shapes: both measures are taken and
recorded, and its prefill FLOPs are the ones the roofline bound counts."""

from __future__ import annotations

import json
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
        "--decoders", "2", "--window-s", "1",
        "--server-flag=--max-num-batched-tokens", "--server-flag=64",
        "--server-flag=--long-prefill-token-threshold", "--server-flag=32"])
    records = long_context.main()
    prefill = [r for r in records if r["test"] == "prefill"]
    assert [(r["prompt"], r["requests"], len(r["ttft_each_s"])) for r in prefill] == [
        (160, 1, 1), (160, 2, 2)]
    assert all(r["prefill_tflops"] > 0 and r["ttft_s"] > 0 for r in prefill)
    inter = next(r for r in records if r["test"] == "interference")
    assert inter["gaps_before"] > 0 and inter["gaps_during"] > 0  # 5 chunks of 32 beside them
    assert inter["short_ttft_ms"] > 0 and inter["long_ttft_s"] > 0
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
    row = [x for x in long_context_section(recs) if x.startswith("| H200")]
    assert row == ["| H200 | llama3.1-8b | 2048 | 1x128k 12.0 s (0.77) | 64: 10 -> 72 ms "
                   "(x7.0); short TTFT 140 ms | c0ffee | 2026-12-05 00:00 |"]
