"""benchmarks/step_overhead.py drives the real engine, its client and a front end's output
processor against a stub executor: it runs, and its decode steps carry every request."""

from __future__ import annotations

import asyncio

from benchmarks import step_overhead


def test_it_measures_decode_steps_of_all_running_requests(tmp_path) -> None:
    rec = asyncio.run(step_overhead.measure(3, 5, f"ipc://{tmp_path}/overhead"))
    assert rec["kind"] == "step_overhead" and rec["running"] == 3
    assert rec["steps"] >= 4  # the first step prefills; each later one decodes all three
    assert rec["plan_us_p50"] > 0 and rec["step_period_us"] > 0
