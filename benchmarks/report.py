"""REPORT.md and its plots from the family records in benchmarks/results/ alone (plots need
matplotlib: `pip install -e ".[bench]"`; without it the tables are still written).

    python -m benchmarks.report            # writes results/REPORT.md and results/*.png
    python -m benchmarks.report --summarise-sweeps   # first: raw sweeps -> best per shape

History tables list every GPU run, oldest first; kernel and W4A16 GEMM tables show the newest
run (the older ones stay in their JSONL). Before/after pairs come from `gpu.sh`'s ab part.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from statistics import fmean

from benchmarks.common import RESULTS, read, step_split

# Measured on this H200 by the issue's author (../shared/BENCHMARKS.md), output tok/s.
ANCHORS = {("W1", "llama3.1-8b"): "HF generate bs256 4,469; HF CB 535",
           ("W1", "llama3.2-1b"): "HF generate bs256 10,840; HF CB 1,054",
           ("W2", "llama3.1-8b"): "HF CB 483; HF static did not finish in 400 s",
           ("W2", "llama3.2-1b"): "HF static 1,163; HF CB 1,040 (1,457 tuned)"}
TARGETS = {("W1", "llama3.1-8b"): 0.8, ("W1", "llama3.2-1b"): 0.6,
           ("W2", "llama3.1-8b"): 0.7, ("W2", "llama3.2-1b"): 0.5}


def load(family: str) -> list[dict]:
    path = RESULTS / f"{family}.jsonl"
    return read(path) if path.exists() else []


def runs(records: Iterable[dict]) -> dict[str, list[dict]]:
    """Records by run, in the order of the file (oldest first)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        out[r["run"]].append(r)
    return out


def num(x, fmt: str = ",.0f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def when(rec: dict) -> str:
    return rec["recorded_at"].removesuffix("Z").replace("T", " ")[:16]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def _flag(command: str, name: str, default: str) -> str:
    m = re.search(rf"{name}[= ](\S+)", command)
    return m.group(1) if m else default


# async scheduling is serve's default from b03d9f2 on: records after it without
# --no-async-scheduling ran with two steps in flight too
ASYNC_DEFAULT_SINCE = "2026-12-01T02:55:14Z"


def _overlapped(r: dict) -> bool:
    flags = r.get("server_flags", "")
    return "--async-scheduling" in flags or (
        "--no-async-scheduling" not in flags and r.get("recorded_at", "") >= ASYNC_DEFAULT_SINCE)


def _step(r: dict) -> str:
    if "step_ms" not in r:
        return "-"
    if _overlapped(r):
        # two steps in flight: their times overlap, so they do not add up to the step
        return f"{r['step_ms']:.1f} (overlapped: plan {r['plan_ms']:.1f}, executor " \
               f"{r['execute_ms']:.1f})"
    rest = r["step_ms"] - r["plan_ms"] - r["execute_ms"]
    return f"{r['step_ms']:.1f} = {r['plan_ms']:.1f} + {r['execute_ms']:.1f} + {rest:.1f}"


def throughput_section(records: list[dict]) -> list[str]:
    rows = []
    for recs in runs(r for r in records if r.get("gpu") and "ab" not in r).values():
        ours = next((r for r in recs if r["engine"] == "pagedserve"), None)
        if ours is None or not str(ours.get("model", "")).startswith("llama"):
            continue
        key = (ours["workload"], ours["model"])
        flags = ours.get("server_flags", "")
        peers = [next((r for r in recs if r["engine"] == e), None)
                 for e in ("hf_generate", "hf_continuous_batching")]
        rows.append([
            when(ours), ours["commit"], *key,
            _flag(ours["command"], "--max-num-batched-tokens", "2048"),
            _flag(flags, "--stream-interval", "1"),
            " ".join([*re.sub(r"--stream-interval \S+", "", flags).split(),
                      *(f"{k}={v}" for k, v in ours.get("sampling", {}).items())]) or "-",
            num(ours["output_tok_s"]), num(ours.get("bound_output_tok_s")),
            f"{num(ours.get('roofline_fraction'), '.2f')} ({TARGETS.get(key, '-')})",
            " / ".join(num(r and r["output_tok_s"]) for r in peers), _step(ours),
            num(ours.get("kv_token_utilization_at_peak"), ".3f"),
            num(ours.get("weight_gib"), ".2f"), num(ours.get("kv_capacity_tokens"))])
    header = ["recorded (UTC)", "commit", "workload", "model", "step budget", "stream interval",
              "other flags", "pagedserve out tok/s", "bound", "fraction (target)",
              "HF generate bs256 / HF CB, same run",
              "per step: total = plan + executor + rest (ms)", "KV token use at peak",
              "weights GiB", "KV tokens"]
    return ["## Offline throughput (W1, W2, decode shapes), through the gRPC service", "",
            *table(header, rows), "",
            "Peers measured on this H200 by the issue's author (output tok/s): " + "; ".join(
                f"{w} {m}: {a}" for (w, m), a in ANCHORS.items()) + ".", ""]


def ab_section(records: list[dict]) -> list[str]:
    """Baseline and current runs of one `gpu.sh ab` session, alternated, side by side."""
    pairs: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if "ab" in r and r["engine"] == "pagedserve":
            pairs[(r.get("ab_session", "-"), r["workload"], r["model"])][r["ab"]].append(r)
    rows = []
    for (session, workload, model), sides in pairs.items():
        base, cur = sides.get("baseline", []), sides.get("current", [])

        def cell(rs: list[dict]) -> str:
            commits = ", ".join(sorted({r["commit"] for r in rs})) or "-"
            return f"{' / '.join(num(r['output_tok_s']) for r in rs) or '-'} ({commits})"

        ratio = fmean(r["output_tok_s"] for r in cur) / fmean(
            r["output_tok_s"] for r in base) if base and cur else None
        rows.append([session, workload, model, cell(base), cell(cur), num(ratio, ".3f")])
    if not rows:
        return []
    return ["## Before / after (same session, runs alternated)", "",
            *table(["session", "workload", "model", "baseline out tok/s per round (commit)",
                    "current out tok/s per round (commit)", "current / baseline (means)"],
                   rows), ""]


def serve_section(records: list[dict]) -> list[str]:
    gpu = [r for r in records if r.get("gpu")]
    w3 = [[when(r), r["commit"], r["model"], r["rate"], num(r["request_rps"], ".1f"),
           num(r["output_tok_s"]), f"{num(r['ttft_p50_ms'])} / {num(r['ttft_p99_ms'])}",
           f"{num(r['tpot_p50_ms'], '.1f')} / {num(r['tpot_p99_ms'], '.1f')}",
           num(r["itl_p99_ms"], ".1f"), num(r["goodput_rps"], ".1f")]
          for r in gpu if r["workload"] == "W3"]
    prefix = [[when(r), r["commit"], r["model"], r["shared_prefix"], r.get("prefix_caching"),
               r["rate"], r["completed"], num(r["output_tok_s"]),
               f"{num(r['ttft_p50_ms'])} / {num(r['ttft_p99_ms'])}"]
              for r in gpu if r["workload"] == "W3-shared-prefix"]
    overload = [[when(r), r["commit"], r["model"], r["rate"], r.get("priority", "all"),
                 r["completed"], r["refused"], f"{num(r['ttft_p50_ms'])} / "
                 f"{num(r['ttft_p99_ms'])}", r["server_flags"] or "-"]
                for r in gpu if r["workload"] == "overload-priority"]
    return ["## Serving (W3), Poisson arrivals through gRPC", "",
            *table(["recorded (UTC)", "commit", "model", "rate (req/s)", "completed req/s",
                    "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p99 ms",
                    "goodput req/s (TTFT 250 ms, TPOT 30 ms)"], w3), "",
            "### W3 with a shared system prompt, prefix caching on and off", "",
            *table(["recorded (UTC)", "commit", "model", "shared prefix tokens",
                    "prefix caching", "rate", "completed", "out tok/s", "TTFT p50 / p99 ms"],
                   prefix), "",
            "### Overload with priorities (10 % high) and a bounded queue", "",
            *table(["recorded (UTC)", "commit", "model", "rate", "class", "completed",
                    "refused", "TTFT p50 / p99 ms", "server flags"], overload), ""]


def _at_defaults(r: dict) -> bool:
    """A run with the flags a user gets: serve's own step bounds, nothing else asked."""
    return (r.get("gpu") and "--max-num-seqs 0" in r.get("command", "")
            and "--max-num-batched-tokens 0" in r["command"] and not r.get("server_flags")
            and not r.get("sampling") and "ab" not in r)


def defaults_section(throughput: list[dict], serve: list[dict]) -> list[str]:
    """The default-flag targets beside the newest run that measures each (H200, 8B and 1B
    random weights, through gRPC)."""
    rows = []
    for w, m, target in (("W1", "llama3.1-8b", 0.82), ("W2", "llama3.1-8b", 0.78),
                         ("W1", "llama3.2-1b", 0.65), ("W2", "llama3.2-1b", 0.60)):
        r = next((r for r in reversed(throughput) if r["workload"] == w and r["model"] == m
                  and _at_defaults(r)), None)
        got = r and r.get("roofline_fraction")
        rows.append([f"{w} {m}: fraction of the bound", f">= {target}",
                     f"{num(got, '.2f')} ({num(r and r['output_tok_s'])} out tok/s)",
                     r and r["commit"], got is not None and got >= target, step_split(r)])
    gpu = [r for r in serve if r.get("gpu") and not r.get("server_flags")
           and r["model"] == "llama3.1-8b"]
    w3 = [r for r in gpu if r["workload"] == "W3" and r["num_requests"] == 1000
          and "max_num_seqs" in r]  # runs that record the step bounds used ran at defaults
    inf = next((r for r in reversed(w3) if r["rate"] == "inf"), None)
    rows.append(["W3 at rate=inf, 1,000 requests", ">= 12,500 out tok/s",
                 num(inf and inf["output_tok_s"]), inf and inf["commit"],
                 inf is not None and inf["output_tok_s"] >= 12500, step_split(inf)])
    paced = next((r for r in reversed(w3) if inf and r["run"] == inf["run"]
                  and r["rate"] != "inf"), None)
    ok = paced is not None and paced["ttft_p99_ms"] <= 150 and paced["tpot_p99_ms"] <= 30
    rows.append(["W3 at 80 % of the rate sustained at inf: TTFT p99 / TPOT p99",
                 "<= 150 / 30 ms", paced and f"{num(paced['ttft_p99_ms'])} / "
                 f"{num(paced['tpot_p99_ms'], '.1f')} at {paced['rate']} req/s",
                 paced and paced["commit"], ok, step_split(paced)])
    pre = [r for r in serve if r.get("gpu") and r["workload"] == "W3-shared-prefix"
           and r["model"] == "llama3.1-8b" and r["shared_prefix"] == 2000]
    on = next((r for r in reversed(pre) if r.get("prefix_caching") == "on"), None)
    off = next((r for r in reversed(pre) if r.get("prefix_caching") == "off"), None)
    ratio = on and off and on["ttft_p50_ms"] / off["ttft_p50_ms"]
    rows.append(["2,000-token shared prefix: TTFT p50 caching on / off", "<= 0.4",
                 ratio and f"{ratio:.2f} ({num(on['ttft_p50_ms'])} / {num(off['ttft_p50_ms'])}"
                 f" ms)", on and on["commit"], bool(ratio) and ratio <= 0.4, step_split(on)])
    for row in rows:
        row[3] = row[3] or "-"
        row[2] = row[2] or "not measured"
        row[4] = "met" if row[4] else "missed"
    return ["## Targets at the default flags (H200, through gRPC)", "",
            "Per step, ms: the wall time per step, then (runs since the phase counters) the "
            "device's busy time and gaps, the scheduler loop's phases and the executor's host "
            "phases (docs/performance.md, \"Where a step's time goes\"); older runs: plan, "
            "round trip and executor time.", "",
            *table(["what", "target", "newest run", "commit", "", "per step (ms)"], rows), ""]


def step_overhead_section(records: list[dict]) -> list[str]:
    loops = [r for r in records if r.get("kind", "step_overhead") == "step_overhead"]
    rows = [[when(r), r["commit"], r["gpu"] or "CPU", r["running"], r.get("tokenizer", "-"),
             r.get("async_scheduling", "-"), num(r["plan_us_p50"]),
             num(r["round_trip_us_p50"]), num(r["executor_us_p50"]),
             num(r.get("step_period_us"))] for r in loops]
    grpc = [[when(r), r["commit"], r["gpu"] or "CPU", r["streams"],
             num(r["server_wall_us_per_message"], ".1f"),
             num(r["server_cpu_us_per_message"], ".1f")]
            for r in records if r.get("kind") == "grpc_stream"]
    out = ["## Step overhead (stub model: host work per step)", "",
           *table(["recorded (UTC)", "commit", "machine (GPU)", "running", "tokenizer",
                   "async", "plan p50 us", "round trip p50 us", "executor p50 us",
                   "step period us"], rows), ""]
    if grpc:
        out += ["## One streamed gRPC message (benchmarks/grpc_stream.py: the server's cost)", "",
                *table(["recorded (UTC)", "commit", "machine (GPU)", "streams",
                        "server wall us / message", "server CPU us / message"], grpc), ""]
    return out


def load_section(records: list[dict]) -> list[str]:
    """benchmarks/load.py: completions by status, latency and memory, per phase of each run."""
    if not records:
        return []
    rows = []
    for r in records:
        for phase in ("burst", "stall", "soak"):
            ph = r.get(phase) or {}
            statuses = ph.get("by_status") or {**{f"under {k}": v for k, v in ph.get(
                "under_by_status", {}).items()}, **{f"over {k}": v for k, v in ph.get(
                    "over_by_status", {}).items()}}
            latency = (f"{num(ph.get('ttft_p50_ms'))} / {num(ph.get('ttft_p99_ms'))}"
                       if "ttft_p50_ms" in ph else
                       f"probe {ph.get('probe_alone_s')} s alone, {ph.get('probe_beside_s')} s "
                       f"beside (max gap {ph.get('probe_beside_max_gap_ms')} ms)")
            rows.append([when(r), r["commit"], phase, ph.get("requests", ph.get("big_prompts")),
                         ", ".join(f"{k} {v}" for k, v in statuses.items()), latency,
                         num(ph.get("e2el_p50_ms")), num(ph.get("e2el_p99_ms")),
                         ph.get("kv_blocks_in_use_after"), ph.get("load_avg_1m_before")])
    last = records[-1]
    mem = ", ".join(f"{k}: scheduler {v['scheduler']}, executor {v['executor']}"
                    for k, v in last["rss_mib"].items())
    return ["## Load and soak (CPU default model, `benchmarks/load.py`)", "",
            *table(["recorded (UTC)", "commit", "phase", "requests", "by status",
                    "TTFT p50 / p99 ms", "E2E p50 ms", "E2E p99 ms", "KV blocks in use after",
                    "load avg before"], rows), "",
            f"Resident memory of the last run, MiB: {mem}; peak {last['rss_peak_mib']}.", "",
            "![resident memory over the last load run](load_memory.png)", ""]


def kernels_section(records: list[dict]) -> list[str]:
    records = [r for r in records if r["kind"] in ("decode", "prefill")]
    if not records:
        return []
    name, recs = list(runs(records).items())[-1]
    by = defaultdict(dict)
    for r in recs:
        if r["kind"] in ("decode", "prefill"):
            by[(r["kind"], r["batch"], r["ctx"], r.get("q_len", "-"))][r["impl"]] = r
    rows = []
    for (kind, batch, ctx, q_len), impls in by.items():
        unit = "tbps" if kind == "decode" else "tflops"
        ours, ref = impls.get("pagedserve", {}), impls.get("torch_sdpa", {})
        rows.append([kind, batch, ctx, q_len, num(ours.get("ms"), ".4f"),
                     num(ours.get(unit), ".2f"), num(ref.get("ms"), ".4f"),
                     num(ref.get(unit), ".2f")])
    return [f"## Attention kernels (newest run: {name}, commit {recs[0]['commit']})", "",
            *table(["kind", "batch", "ctx", "q len", "pagedserve ms", "TB/s or TFLOP/s",
                    "torch SDPA ms", "TB/s or TFLOP/s"], rows), ""]


def w4a16_section(records: list[dict]) -> list[str]:
    if not records:
        return []
    name, recs = list(runs(records).items())[-1]
    by = defaultdict(dict)
    for r in recs:
        by[(r["rows"], r["n"], r["k"])][r["impl"]] = r
    rows = [[m, n, k, num(i.get("torch_matmul", {}).get("ms", math.nan) * 1e3, ".1f"),
             *(f"{num(i[impl]['ms'] * 1e3, '.1f')} ({i[impl]['speedup_vs_bf16']:.2f}x)"
               if impl in i else "-"
               for impl in ("default", "default+act_order", "stream_floor"))]
            for (m, n, k), i in by.items()]
    return [f"## W4A16 GEMM (newest run: {name}, commit {recs[0]['commit']})", "",
            *table(["rows", "n", "k", "bf16 us", "AWQ us (vs bf16)", "GPTQ act-order us",
                    "int4 read floor us"], rows), ""]


def fp8_kv_section(records: list[dict]) -> list[str]:
    recs = [r for r in records if r["kind"] == "decode_fp8kv"]
    rows = [[when(r), r["commit"], r.get("gpu") or "cpu", f"{r['batch']} x {r['ctx']}",
             r["kv_cache_dtype"], num(r["ms"], ".4f"), num(r["tbps"], ".2f"),
             f"{r['speedup_vs_bf16']:.2f}x"] for r in recs if not r.get("smoke")]
    if not rows:
        return []
    return ["## Decode attention on an FP8 KV cache (`bench_fp8_kv.py`; configs: "
            "`decode_fp8kv_sweep` in kernels.jsonl)", "",
            *table(["recorded (UTC)", "commit", "gpu", "batch x ctx", "kv cache", "ms",
                    "TB/s", "vs bf16"], rows), ""]


def fp8_gemm_section(records: list[dict]) -> list[str]:
    if not records:
        return []
    name, recs = list(runs(records).items())[-1]
    by = defaultdict(dict)
    for r in recs:
        by[(r["shape"], r["n"], r["k"], r["rows"])][r["impl"]] = r
    rows = [[shape, n, k, m, num(i.get("bf16", {}).get("ms", math.nan) * 1e3, ".1f"),
             num(i.get("fp8", {}).get("ms", math.nan) * 1e3, ".1f"),
             f"{i['bf16']['ms'] / i['fp8']['ms']:.2f}x" if "bf16" in i and "fp8" in i else "-",
             num(i.get("gemm_only", {}).get("ms", math.nan) * 1e3, ".1f")]
            for (shape, n, k, m), i in by.items()]
    return [f"## FP8 GEMM (newest run: {name}, commit {recs[0]['commit']}, "
            f"{recs[0].get('gpu') or 'cpu'})", "",
            *table(["shape", "n", "k", "rows", "bf16 us", "fp8 us (quant + GEMM)", "vs bf16",
                    "GEMM alone us"], rows), ""]


def structured_section(records: list[dict]) -> list[str]:
    rows = []
    for recs in runs(records).values():
        by = {(r["concurrency"], r["constrained"]): r for r in recs}
        for (conc, constrained), r in sorted(by.items()):
            if not constrained or (conc, False) not in by:
                continue
            plain = by[(conc, False)]["tpot_p50_ms"]
            rows.append([when(r), r["commit"], r.get("gpu") or "cpu", r["model"], conc,
                         num(plain, ".2f"), num(r["tpot_p50_ms"], ".2f"),
                         f"{(r['tpot_p50_ms'] / plain - 1) * 100:+.1f} %",
                         num(r["bitmask_ms_per_step"], ".2f"),
                         num(r["plan_ms_per_step"], ".2f")])
    if not rows:
        return []
    return ["## Structured outputs: JSON-schema requests against the same run unconstrained", "",
            *table(["recorded (UTC)", "commit", "gpu", "model", "running", "TPOT plain ms",
                    "TPOT JSON ms", "vs plain", "bitmask ms/step", "plan ms/step"], rows), ""]


def perplexity_section(records: list[dict]) -> list[str]:
    # records before the FP8 KV cache ran over a float cache ("auto")
    rows = [[when(r), r["commit"], r["model"], r["method"], num(r["group_size"], "d")
             if r["group_size"] else "-", r.get("kv_cache_dtype", "auto"), num(r["ppl"], ".3f"),
             r["tokens"]] for r in records]
    return ["## Perplexity of quantized weights and KV cache", "",
            *table(["recorded (UTC)", "commit", "model", "method", "group", "kv cache", "ppl",
                    "tokens"], rows), ""]


def plots(throughput: list[dict], serve: list[dict]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: matplotlib is not installed)"]
    out = []
    series = defaultdict(list)  # pagedserve W1/W2 runs on the GPU, by workload and model
    for r in throughput:
        if r.get("gpu") and r["engine"] == "pagedserve" and r["workload"] in ("W1", "W2") \
                and "ab" not in r:
            series[(r["workload"], r["model"])].append(r)
    if series:
        fig, ax = plt.subplots(figsize=(7, 4))
        for (w, m), rs in sorted(series.items()):
            ax.plot([datetime.fromisoformat(r["recorded_at"]) for r in rs],
                    [r["output_tok_s"] for r in rs], "o-", label=f"{w} {m}")
        ax.set_xlabel("recorded (UTC; every flag set)")
        fig.autofmt_xdate()
        ax.set_ylabel("output tok/s")
        ax.set_title("pagedserve offline throughput, history")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS / "throughput_history.png", dpi=100)
        plt.close(fig)
        out.append("![throughput history](throughput_history.png)")
    w3 = runs(r for r in serve if r.get("gpu") and r["workload"] == "W3")
    if w3:
        name, recs = list(w3.items())[-1]
        paced = [r for r in recs if r["rate"] != "inf"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([float(r["rate"]) for r in paced], [r["output_tok_s"] for r in paced], "o-",
                label="output tok/s")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("output tok/s")
        ax2 = ax.twinx()
        ax2.plot([float(r["rate"]) for r in paced], [r["ttft_p99_ms"] for r in paced], "s--",
                 color="tab:red", label="TTFT p99 ms")
        ax2.set_ylabel("TTFT p99 (ms)")
        ax.set_title(f"W3 {recs[0]['model']}: throughput vs rate ({when(recs[0])})")
        fig.tight_layout()
        fig.savefig(RESULTS / "w3_throughput_vs_rate.png", dpi=100)
        plt.close(fig)
        out.append("![W3 throughput vs rate](w3_throughput_vs_rate.png)")
    return out


# Raw sweeps (a grid of kernel configs per shape) stay out of the family files: each shape's
# fastest correct config of a run stays, with how many configs were timed and how many gave
# wrong results; the raw lines go to archive/<date>_<family>_sweeps.jsonl.xz.
SWEEPS = {"w4a16_gemm": (lambda r: r.get("impl") in ("sweep", "sweep_wrong"),
                         ("run", "method", "group_size", "rows", "n", "k")),
          "kernels": (lambda r: "sweep" in r.get("kind", ""),
                      ("run", "kind", "kv_cache_dtype", "widen_to", "batch", "ctx", "q_len"))}


def raw_sweep(family: str, rec: dict) -> bool:
    return family in SWEEPS and SWEEPS[family][0](rec) and "sweep_configs" not in rec


def summarise_sweeps(family: str, folder: Path = RESULTS) -> int:
    """Collapses the family's raw sweep records to the best config per shape and run (in the
    place of the shape's first record) and archives the raw lines by date; returns how many
    raw records it removed."""
    path = folder / f"{family}.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    shapes: dict[tuple, list[dict]] = defaultdict(list)
    raw_by_date: dict[str, list[str]] = defaultdict(list)
    out: list[str | tuple] = []
    for line in lines:
        rec = json.loads(line)
        if not raw_sweep(family, rec):
            out.append(line)
            continue
        key = tuple(rec.get(f) for f in SWEEPS[family][1])
        if key not in shapes:
            out.append(key)
        shapes[key].append(rec)
        raw_by_date[rec["recorded_at"][:10]].append(line)
    if not shapes:
        return 0
    for date, raw in raw_by_date.items():
        archive = folder / "archive" / f"{date}_{family}_sweeps.jsonl.xz"
        archive.parent.mkdir(exist_ok=True)
        held = lzma.decompress(archive.read_bytes()).decode() if archive.exists() else ""
        with lzma.open(archive, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
            f.write(held + "\n".join(raw) + "\n")

    def best(recs: list[dict]) -> str:
        ok = [r for r in recs if r.get("impl") != "sweep_wrong" and math.isfinite(r["ms"])]
        top = min(ok or recs, key=lambda r: r["ms"])
        return json.dumps({**top, "sweep_configs": len(recs), "sweep_wrong": len(recs) - len(ok),
                           "sweep_archive": f"archive/{top['recorded_at'][:10]}_{family}"
                                            "_sweeps.jsonl.xz"})
    path.write_text("".join((best(shapes[x]) if isinstance(x, tuple) else x) + "\n"
                            for x in out))
    return sum(map(len, shapes.values())) - len(shapes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summarise-sweeps", action="store_true",
                   help="collapse raw sweeps to their best config per shape first (SWEEPS)")
    args = p.parse_args()
    for family in SWEEPS if args.summarise_sweeps else ():
        if (RESULTS / f"{family}.jsonl").exists():
            print(f"{family}: {summarise_sweeps(family)} raw sweep records archived")
    throughput, serve = load("throughput"), load("serve")
    lines = ["# Results (generated by `python -m benchmarks.report` from the JSONL files here; "
             "do not edit)", "",
             *ab_section(throughput), *throughput_section(throughput),
             *defaults_section(throughput, serve), *serve_section(serve),
             *step_overhead_section(load("step_overhead")), *load_section(load("load")),
             *kernels_section(load("kernels")), *fp8_kv_section(load("kernels")),
             *w4a16_section(load("w4a16_gemm")), *fp8_gemm_section(load("fp8_gemm")),
             *structured_section(load("structured")), *perplexity_section(load("perplexity")),
             *plots(throughput, serve), ""]
    path = RESULTS / "REPORT.md"
    path.write_text("\n".join(lines))
    print("wrote", path)


if __name__ == "__main__":
    main()
