"""benchmarks/common.py: a run's step breakdown from two metric scrapes."""

import pytest

from benchmarks.common import ENV_SWITCHES, step_breakdown, step_split


def test_step_breakdown_counts_tokens_a_step_and_the_loops_unaccounted_time():
    before = {'pagedserve_executor_steps_total{mode="cuda_graph"}': 10.0,
              "pagedserve_generation_tokens_total": 100.0}
    after = {'pagedserve_executor_steps_total{mode="cuda_graph"}': 90.0,
             'pagedserve_executor_steps_total{mode="eager"}': 20.0,
             "pagedserve_generation_tokens_total": 100.0 + 100 * 192,
             'pagedserve_scheduler_loop_seconds_total{phase="plan"}': 0.1,
             'pagedserve_scheduler_loop_seconds_total{phase="await_executor"}': 1.1}
    r = step_breakdown(before, after, wall=2.0)  # 100 steps in 2 s, 12 ms of them accounted
    assert (r["graph_steps"], r["eager_steps"]) == (80.0, 20.0)
    assert r["step_ms"] == pytest.approx(20.0) and r["tokens_per_step"] == pytest.approx(192.0)
    assert r["loop_unaccounted_ms"] == pytest.approx(8.0)
    assert r["scheduler_loop_ms"]["plan"] == pytest.approx(1.0)
    split = step_split(r)
    assert split.startswith("20.0 (192.0 tokens a step, 8.00 ms outside the loop's phases); ")
    assert "scheduler plan 1.00 await_executor 11.00" in split



def test_switches_read_the_defaults_and_what_the_environment_sets():
    """Records keep every switch's effective value, defaults included (the modules read the
    environment at import: each case is a fresh process)."""
    import json
    import os
    import subprocess
    import sys

    code = "import json; from benchmarks.common import switches; print(json.dumps(switches()))"
    clean = {k: v for k, v in os.environ.items() if k not in ENV_SWITCHES}

    def run(**env: str) -> dict:
        out = subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    defaults = {"moe_fuse_silu_tokens": 64, "moe_fuse_route": True, "moe_decode_tokens": 0,
                "dense_gemv_rows": 1, "dense_gemv_max_mib": 24.0, "dense_gemv_block": "dense_tiles",
                "prefill_kernel": "auto", "latent_expand_rows": 64,
                "latent_expand_tokens": 32768}
    assert run() == defaults
    assert run(PAGEDSERVE_MOE_FUSE_SILU="0", PAGEDSERVE_PREFILL_KERNEL="hopper",
               PAGEDSERVE_DENSE_GEMV_MAX_MIB="8", PAGEDSERVE_DENSE_GEMV_BLOCK="4x1024",
               PAGEDSERVE_LATENT_EXPAND_ROWS="0") == {
        **defaults, "moe_fuse_silu_tokens": 0, "prefill_kernel": "hopper",
        "dense_gemv_max_mib": 8.0, "dense_gemv_block": "4x1024", "latent_expand_rows": 0}
