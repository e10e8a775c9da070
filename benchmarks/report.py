"""REPORT.md and its plots from the family records in benchmarks/results/ alone.

    python -m benchmarks.report                      # writes results/REPORT.md and results/*.png
    python -m benchmarks.report --summarise-sweeps   # first: raw sweeps -> best per shape

Each table shows the newest record of every target: a workload, model and settings; a peer;
a kernel shape. The records before it stay in their JSONL (the history), and the plots draw
that history: throughput and fraction of the bound over commits. Plots need matplotlib
(`pip install -e ".[bench]"`); without it the tables are still written and the PNGs stay.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import lzma
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from statistics import fmean

from benchmarks.common import RESULTS, read, step_split

# Measured on this H200 by the issue's author (../shared/BENCHMARKS.md), output tok/s.
ANCHORS = {("W1", "llama3.1-8b"): "HF generate bs256 4,469; HF CB 535",
           ("W1", "llama3.2-1b"): "HF generate bs256 10,840; HF CB 1,054",
           ("W2", "llama3.1-8b"): "HF CB 483; HF static did not finish in 400 s",
           ("W2", "llama3.2-1b"): "HF static 1,163; HF CB 1,040 (1,457 tuned)"}
# fraction of the bound at the default flags: the open issues' goals (W2 8B: issue 19's;
# 1B and W1 8B: issue 30's; Qwen3-30B-A3B W1: issue 29's, beside 3x HF generate)
TARGETS = {("W1", "llama3.1-8b"): 0.84, ("W2", "llama3.1-8b"): 0.78,
           ("W1", "llama3.2-1b"): 0.68, ("W2", "llama3.2-1b"): 0.62,
           ("W1", "qwen3-30b-a3b"): 0.5}
W3_TARGET = 13000  # out tok/s at rate=inf, 1,000 requests (issue 30)
MOE_SINGLE_STREAM_TARGET = 0.6  # Qwen3-30B-A3B, 1 running, 128 -> 512 (issue 29)
# serve's --api-server-count auto on the goals' host (16 cores: one API process per 8)
AUTO_API_SERVERS = "--api-server-count 2"
PLOTS = {"throughput_history.png": "pagedserve output tok/s over commits (H200)",
         "fraction_history.png": "fraction of the bound over commits (H200, bf16 weights)",
         "w3_history.png": "W3 on Llama-3.1-8B over commits",
         "load_memory.png": "resident memory over the last load run (benchmarks/load.py)"}
# async scheduling is serve's default from b03d9f2 on: records after it without
# --no-async-scheduling ran with two steps in flight too
ASYNC_DEFAULT_SINCE = "2026-12-01T02:55:14Z"


def load(family: str, folder: Path = RESULTS) -> list[dict]:
    path = folder / f"{family}.jsonl"
    return read(path) if path.exists() else []


def runs(records: Iterable[dict]) -> dict[str, list[dict]]:
    """Records by run, in the order of the file (oldest first)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        out[r["run"]].append(r)
    return out


def newest(records: Iterable[dict], key: Callable[[dict], tuple]) -> list[dict]:
    """The newest record of each key, in the order the keys first appear."""
    out: dict[tuple, dict] = {}
    for r in records:
        k = key(r)
        if k not in out or r["recorded_at"] >= out[k]["recorded_at"]:
            out[k] = r
    return list(out.values())


def num(x, fmt: str = ",.0f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def when(rec: dict) -> str:
    return rec["recorded_at"].removesuffix("Z").replace("T", " ")[:16]


def machine(rec: dict) -> str:
    return (rec.get("gpu") or "CPU").removeprefix("NVIDIA ")


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows), ""]


def section(title: str, *parts: list[str] | str) -> list[str]:
    out = [f"## {title}", ""]
    for part in parts:
        out += [part, ""] if isinstance(part, str) else part
    return out


def _flag(command: str, name: str, default: str) -> str:
    m = re.search(rf"{name}[= ](\S+)", command)
    return m.group(1) if m else default


def _overlapped(r: dict) -> bool:
    flags = r.get("server_flags") or ""
    return "--async-scheduling" in flags or (
        "--no-async-scheduling" not in flags and r.get("recorded_at", "") >= ASYNC_DEFAULT_SINCE)


def _profiled(r: dict) -> bool:
    """A run under the torch profiler (its timings carry the profiler's cost)."""
    return "--torch-profile-dir" in (r.get("server_flags") or "")


def settings(r: dict) -> str:
    """What a throughput run asked beyond the defaults, in a few words."""
    words = []
    seqs = _flag(r["command"], "--max-num-seqs", "256")
    tokens = _flag(r["command"], "--max-num-batched-tokens", "2048")
    if (seqs, tokens) != ("0", "0"):
        words.append(f"{seqs} seqs x {tokens} tokens")
    if _profiled(r):
        words.append("torch profile")
    flags = r.get("server_flags") or ""
    if "--scheduler-key" in flags:
        words.append("CurveZMQ keys")
    flags = re.sub(r"--(torch-profile-\S+|\S+-keys?) \S+|--(no-)?async-scheduling", "", flags)
    words += [" ".join(flags.split())] if flags.strip() else []
    words += [] if _overlapped(r) else ["sync"]
    words += [f"{k}={v}" for k, v in r.get("sampling", {}).items()]
    words += [f"{k}={v}" for k, v in r.get("env", {}).items()]
    return ", ".join(words) or "defaults"


def step_short(r: dict) -> str:
    """A run's step clocks in one short cell: wall time per step, the device's busy time and
    gaps, each process's CPU (common.step_split has every phase)."""
    if "step_ms" not in r:
        return "-"
    out = f"{r['step_ms']:.1f}"
    if any(r.get("device_ms", {}).values()):
        out += f": device {r['device_ms']['busy']:.2f} busy / {r['device_ms']['gap']:.2f} gap"
    if "cpu_ms" in r:
        out += f"; CPU scheduler {r['cpu_ms']['scheduler']:.2f}, executor " \
               f"{r['cpu_ms']['executor']:.2f}"
    if "device_ms" not in r:
        out += f": plan {r['plan_ms']:.2f}, executor {r['execute_ms']:.1f}"
    return out


def _at_defaults(r: dict, asked: str = "") -> bool:
    """A run with the flags a user gets: serve's own step bounds, nothing else asked beyond
    `asked` (settings' words; the API processes named as auto makes them on the goals' host;
    an A/B run's after side)."""
    allowed = (asked, f"{asked}, {AUTO_API_SERVERS}") if asked else ("defaults", AUTO_API_SERVERS)
    return bool(r.get("gpu")) and settings(r) in allowed and r.get("ab") != "baseline"


def _serve_at_defaults(r: dict) -> bool:
    """A serving run (benchmarks.serve) at the flags a user gets, as _at_defaults reads them."""
    return bool(r.get("gpu")) and (r.get("server_flags") or "") in ("", AUTO_API_SERVERS) \
        and r.get("ab") != "baseline"


def defaults_section(throughput: list[dict], serve: list[dict]) -> list[str]:
    """The default-flag targets beside the newest run that measures each (H200, 8B and 1B
    random weights, through gRPC)."""
    rows = []
    throughput = [r for r in throughput if "H200" in (r.get("gpu") or "")]  # the goals' GPU
    serve = [r for r in serve if "H200" in (r.get("gpu") or "")]
    for (w, m), target in TARGETS.items():
        r = next((r for r in reversed(throughput) if r["workload"] == w and r["model"] == m
                  and r["engine"] == "pagedserve" and _at_defaults(r)), None)
        got = r and r.get("roofline_fraction")
        rows.append([f"{w} {m}: fraction of the bound", f">= {target}",
                     f"{num(got, '.2f')} ({num(r and r['output_tok_s'])} out tok/s)",
                     r and r["commit"], got is not None and got >= target, step_split(r)])
    one = next((r for r in reversed(throughput) if r["model"] == "qwen3-30b-a3b"
                and r["workload"] == "2x128->512" and r["engine"] == "pagedserve"
                and _at_defaults(r, "1 seqs x 0 tokens")), None)
    got = one and one.get("roofline_fraction")
    rows.append(["qwen3-30b-a3b single stream (1 running, 128 -> 512): fraction of the bound",
                 f">= {MOE_SINGLE_STREAM_TARGET}",
                 f"{num(got, '.2f')} ({num(one and one['output_tok_s'])} out tok/s)",
                 one and one["commit"], got is not None and got >= MOE_SINGLE_STREAM_TARGET,
                 step_split(one)])
    gpu = [r for r in serve if r["model"] == "llama3.1-8b" and _serve_at_defaults(r)]
    w3 = [r for r in gpu if r["workload"] == "W3" and r["num_requests"] == 1000
          and "max_num_seqs" in r]  # runs that record the step bounds used ran at defaults
    inf = next((r for r in reversed(w3) if r["rate"] == "inf"), None)
    rows.append(["W3 at rate=inf, 1,000 requests", f">= {W3_TARGET:,} out tok/s",
                 num(inf and inf["output_tok_s"]), inf and inf["commit"],
                 inf is not None and inf["output_tok_s"] >= W3_TARGET, step_split(inf)])
    # the newest paced run, at 0.8 of the rate its own run sustained at inf (not always the
    # row above: a call may run inf alone)
    paced = next((r for r in reversed(w3) if r["rate"] != "inf"), None)
    ok = paced is not None and paced["ttft_p99_ms"] <= 150 and paced["tpot_p99_ms"] <= 30
    rows.append(["W3 at 80 % of the rate its run sustained at inf: TTFT p99 / TPOT p99",
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
    return section(
        "Targets at the default flags (H200, through gRPC)",
        "Per step, ms: the wall time per step, then the device's busy time and gaps, each "
        "process's CPU, the scheduler loop's phases and the executor's host phases "
        "(docs/performance.md, \"Where a step's time goes\"); runs before the phase counters: "
        "plan, round trip and executor time.",
        table(["what", "target", "newest run", "commit", "", "per step (ms)"], rows))


def _days_before(stamp: str, days: int) -> str:
    """An ISO recorded_at `days` before `stamp`, in the same format (compares as text)."""
    t = datetime.datetime.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S") - datetime.timedelta(days)
    return t.strftime("%Y-%m-%dT%H:%M:%S")


def throughput_section(records: list[dict]) -> list[str]:
    # profiled runs are diagnostics: records only
    ours = [r for r in records if r["engine"] == "pagedserve" and r.get("ab") != "baseline"
            and not _profiled(r)]
    # settings superseded: a run 2 days older than its workload and model's newest on that
    # machine stays in the records (and the history plots), not in this table; so do runs
    # with PAGEDSERVE_* switches (experiments) of an older commit than the newest such run
    def kind(r: dict) -> tuple:
        return r["workload"], r["model"], machine(r)

    latest = {kind(r): r["recorded_at"] for r in newest(ours, kind)}
    trial = {kind(r): r["commit"] for r in newest((r for r in ours if r.get("env")), kind)}
    ours = [r for r in ours if r["recorded_at"] >= _days_before(latest[kind(r)], 2)
            and (not r.get("env") or r["commit"] == trial[kind(r)])]
    rows = [[r["workload"], r["model"], machine(r), settings(r), num(r["output_tok_s"]),
             num(r.get("bound_output_tok_s")),
             f"{num(r.get('roofline_fraction'), '.2f')}"
             + (f" ({TARGETS[r['workload'], r['model']]})" if _at_defaults(r)
                and (r["workload"], r["model"]) in TARGETS else ""),
             step_short(r), r["commit"], when(r)]
            for r in sorted(newest(ours, lambda r: (r["workload"], r["model"], machine(r),
                                                     settings(r))),
                            key=lambda r: (r["workload"], r["model"], settings(r) != "defaults",
                                           r["recorded_at"]))]
    by_run = runs(records)
    peers = []
    for r in newest((r for r in records if r["engine"] != "pagedserve"),
                    lambda r: (r["workload"], r["model"], machine(r), r["engine"],
                               r.get("batch"))):
        ps = next((p for p in by_run[r["run"]] if p["engine"] == "pagedserve"), None)
        peers.append([r["workload"], r["model"], machine(r),
                      f"{r['engine']}" + (f" bs{r['batch']}" if r.get("batch") else ""),
                      num(r["output_tok_s"]), ps and f"{num(ps['output_tok_s'])} ({settings(ps)})",
                      num(ps and ps["output_tok_s"] / r["output_tok_s"], ".2f"), r["commit"],
                      when(r)])
    return section(
        "Offline throughput: newest run of each workload, model and settings",
        "Through the gRPC service, all requests at once. Settings: what the run asked beyond "
        "the defaults (step bounds `seqs x tokens` where not by device; `sync`: without async "
        "scheduling). Fraction: of the run's bound (FP8 and AWQ runs: against a bf16 bound); "
        "the target in brackets. Per step, ms: wall time, device busy / gap, CPU per process (runs "
        "before the phase counters: plan and executor time, which overlap under async "
        "scheduling).",
        table(["workload", "model", "machine", "settings", "out tok/s", "bound", "fraction",
               "per step (ms)", "commit", "recorded (UTC)"], rows),
        "### Peers, newest run of each (pagedserve in the same run beside it)",
        table(["workload", "model", "machine", "peer", "peer out tok/s",
               "pagedserve, same run (settings)", "pagedserve / peer", "commit",
               "recorded (UTC)"], peers),
        "Peers measured on this H200 by the issue's author (output tok/s, warm): " + "; ".join(
            f"{w} {m}: {a}" for (w, m), a in ANCHORS.items()) + ".")


def ab_section(records: list[dict]) -> list[str]:
    """The newest `gpu.sh ab` session: baseline and current runs, alternated, side by side."""
    ab = [r for r in records if "ab" in r and r["engine"] == "pagedserve"]
    if not ab:
        return []
    def pair(r: dict) -> tuple:
        return r["workload"], r["model"]

    # each workload and model's newest session, of those of the newest session's day
    day = max(r["recorded_at"] for r in ab)[:10]
    latest = {pair(r): r.get("ab_session", "-")
              for r in newest((r for r in ab if r["recorded_at"][:10] == day), pair)}
    session = ", ".join(dict.fromkeys(latest.values()))
    pairs: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in ab:
        if latest.get(pair(r)) == r.get("ab_session", "-"):
            pairs[pair(r)][r["ab"]].append(r)
    rows = []
    for (workload, model), sides in pairs.items():
        base, cur = sides.get("baseline", []), sides.get("current", [])

        def cell(rs: list[dict]) -> str:
            commits = ", ".join(sorted({r["commit"] for r in rs})) or "-"
            return f"{' / '.join(num(r['output_tok_s']) for r in rs) or '-'} ({commits})"

        ratio = fmean(r["output_tok_s"] for r in cur) / fmean(
            r["output_tok_s"] for r in base) if base and cur else None
        rows.append([workload, model, cell(base), cell(cur), num(ratio, ".3f")])
    return section(f"Newest before / after sessions ({session}, runs alternated)",
                   table(["workload", "model", "baseline out tok/s per round (commit)",
                          "current out tok/s per round (commit)", "current / baseline"], rows))


def _rate(r: dict) -> str:
    return "0.8 x inf's" if r["rate"] != "inf" and "--overload" in r["command"] else r["rate"]


def serve_section(records: list[dict]) -> list[str]:
    gpu = [r for r in records if r.get("gpu")]
    w3 = [[r["model"], r["rate"], r["num_requests"], r["server_flags"] or "defaults",
           "on" if _overlapped(r) else "off", num(r["request_rps"], ".1f"),
           num(r["output_tok_s"]), f"{num(r['ttft_p50_ms'])} / {num(r['ttft_p99_ms'])}",
           f"{num(r['tpot_p50_ms'], '.1f')} / {num(r['tpot_p99_ms'], '.1f')}",
           num(r["itl_p99_ms"], ".1f"), num(r["goodput_rps"], ".1f"), step_short(r),
           r["commit"], when(r)]
          for r in newest((r for r in gpu if r["workload"] == "W3"),
                          lambda r: (r["model"], _rate(r), r["server_flags"]))]
    prefix = [[r["model"], r["shared_prefix"], r.get("prefix_caching"), r["rate"],
               r["completed"], num(r["output_tok_s"]),
               f"{num(r['ttft_p50_ms'])} / {num(r['ttft_p99_ms'])}", r["commit"], when(r)]
              for r in newest((r for r in gpu if r["workload"] == "W3-shared-prefix"),
                              lambda r: (r["model"], r["shared_prefix"],
                                         r.get("prefix_caching")))]
    overload = list(runs(r for r in gpu if r["workload"] == "overload-priority").values())
    last = [[r["rate"], r.get("priority") or "all", r["completed"], r["refused"],
             f"{num(r['ttft_p50_ms'])} / {num(r['ttft_p99_ms'])}"] for r in overload[-1]]
    return section(
        "Serving (W3): newest run of each model, rate and server flags, through gRPC",
        table(["model", "rate (req/s)", "requests", "server flags", "async", "completed req/s",
               "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p99 ms",
               "goodput req/s (TTFT 250, TPOT 30 ms)", "per step (ms)", "commit",
               "recorded (UTC)"], w3),
        "### W3 with a shared system prompt, prefix caching on and off",
        table(["model", "shared prefix tokens", "prefix caching", "rate", "completed",
               "out tok/s", "TTFT p50 / p99 ms", "commit", "recorded (UTC)"], prefix),
        f"### Overload with priorities (10 % high), bounded queue: newest run "
        f"({overload[-1][0]['model']}, {overload[-1][0]['server_flags']}, commit "
        f"{overload[-1][0]['commit']}, {when(overload[-1][0])})",
        table(["rate", "class", "completed", "refused", "TTFT p50 / p99 ms"], last))


def _tokenizer(r: dict) -> str:
    return Path(r["tokenizer"]).name if r.get("tokenizer") else "-"


def step_overhead_section(records: list[dict]) -> list[str]:
    loops = [r for r in records if r["kind"] == "step_overhead" and r.get("ab") != "baseline"]
    # the first harness recorded no async setting: its rows stand only where a machine has
    # nothing newer
    newer = {machine(r) for r in loops if "async_scheduling" in r}
    loops = [r for r in loops if "async_scheduling" in r or machine(r) not in newer]
    rows = [[machine(r), r["running"], _tokenizer(r), r.get("async_scheduling", "-"),
             r.get("stream_interval") or 1, bool(r.get("curve")), num(r["plan_us_p50"]),
             num(r["round_trip_us_p50"]), num(r["executor_us_p50"]),
             num(r.get("step_period_us")), r["commit"], when(r)]
            for r in sorted(newest(loops, lambda r: (
                machine(r), r["running"], _tokenizer(r), r.get("async_scheduling"),
                r.get("stream_interval") or 1, bool(r.get("curve")))),
                key=lambda r: (machine(r), _tokenizer(r), r["running"], str(r.get(
                    "async_scheduling")), r.get("stream_interval") or 1))]
    grpc = [[machine(r), r["streams"], num(r["server_wall_us_per_message"], ".1f"),
             num(r["server_cpu_us_per_message"], ".1f"), r["commit"], when(r)]
            for r in newest((r for r in records if r["kind"] == "grpc_stream"),
                            lambda r: (machine(r), r["streams"]))]
    return section(
        "Step overhead (stub model: the host's work per step), newest of each setting",
        table(["machine", "running", "tokenizer", "async", "stream interval", "CurveZMQ",
               "plan p50 us", "round trip p50 us", "executor p50 us", "step period us",
               "commit", "recorded (UTC)"], rows),
        "### One streamed gRPC message (benchmarks/grpc_stream.py: the server's cost)",
        table(["machine", "streams", "server wall us / message", "server CPU us / message",
               "commit", "recorded (UTC)"], grpc))


def http_section(records: list[dict]) -> list[str]:
    rows = [[machine(r), r.get("cpu_count"), r["streams"], r["max_tokens"],
             num(r["output_tok_s_mean"]["grpc"], ".1f"), num(r["output_tok_s_mean"]["http"], ".1f"),
             num(r["http_over_grpc"], ".2f"), f"{num(r['grpc'][0]['ttft_p50_ms'])} / "
             f"{num(r['http'][0]['ttft_p50_ms'])}", r["commit"], when(r)]
            for r in newest(records, lambda r: (machine(r), r["streams"], r["max_tokens"]))]
    return section("HTTP (OpenAI API) against gRPC, same server and load, newest of each",
                   table(["machine", "cores", "streams", "max tokens", "gRPC out tok/s",
                          "HTTP out tok/s", "HTTP / gRPC", "TTFT p50 ms gRPC / HTTP",
                          "commit", "recorded (UTC)"], rows)) if rows else []


def load_section(records: list[dict]) -> list[str]:
    """benchmarks/load.py's newest run: completions by status, latency and memory by phase."""
    if not records:
        return []
    last = records[-1]
    rows = []
    for phase in ("burst", "stall", "soak"):
        ph = last.get(phase) or {}
        statuses = ph.get("by_status") or {**{f"under {k}": v for k, v in ph.get(
            "under_by_status", {}).items()}, **{f"over {k}": v for k, v in ph.get(
                "over_by_status", {}).items()}}
        latency = (f"{num(ph.get('ttft_p50_ms'))} / {num(ph.get('ttft_p99_ms'))}"
                   if "ttft_p50_ms" in ph else
                   f"probe {ph.get('probe_alone_s')} s alone, {ph.get('probe_beside_s')} s "
                   f"beside (max gap {ph.get('probe_beside_max_gap_ms')} ms)")
        rows.append([phase, ph.get("requests", ph.get("big_prompts")),
                     ", ".join(f"{k} {v}" for k, v in statuses.items()), latency,
                     num(ph.get("e2el_p50_ms")), num(ph.get("e2el_p99_ms")),
                     ph.get("kv_blocks_in_use_after"), ph.get("load_avg_1m_before")])
    mem = ", ".join(f"{k}: scheduler {v['scheduler']}, executor {v['executor']}"
                    for k, v in last["rss_mib"].items())
    return section(
        f"Load and soak (`benchmarks/load.py`, {machine(last)}, {last['model']} model, "
        f"commit {last['commit']}, {when(last)})",
        table(["phase", "requests", "by status", "TTFT p50 / p99 ms", "E2E p50 ms",
               "E2E p99 ms", "KV blocks in use after", "load avg before"], rows),
        f"Resident memory, MiB: {mem}; peak " + ", ".join(
            f"{k} {v}" for k, v in last["rss_peak_mib"].items()) + ".")


def _shape(r: dict) -> str:
    if r.get("kind") in ("gemv", "gemv_sweep"):  # bench_gemv.py: a projection at M rows
        return f"{r['shape']} M={r['rows']}"
    if "top_k" in r or "gemm" in r:  # bench_moe.py: a model's expert shapes at T tokens
        return f"{r['shape']} T={r['tokens']}" + (f" {r['gemm']}" if "gemm" in r else "")
    if "bytes" in r:
        return f"{r['bytes'] / 2**30:.0f} GiB"
    parts = [f"{k} {r[k]}" for k in ("batch", "ctx", "q_len", "rows") if r.get(k) is not None]
    return ", ".join(parts) or f"{r.get('m')}x{r.get('n')}x{r.get('k')}"


_LAST_NUMBER = re.compile(r"^(.*?)(\d+)$")


def _joined(cells: Iterable) -> str:
    """Cells of merged rows in one: `a / b / c`, a unit they all share said once."""
    cells = [str(c) for c in cells]
    units = {c.split(" ")[1] if c.count(" ") == 1 else None for c in cells}
    if len(units) == 1 and None not in units:
        return " / ".join(c.split(" ")[0] for c in cells) + " " + units.pop()
    return " / ".join(cells)


def _merge_sizes(rows: list[list]) -> list[list]:
    """Rows of one kind and reference whose shapes differ only in their last number (`T=1`,
    `T=16`; `rows 256`, `rows 16384`; `ctx 512`, `ctx 2048`) as one row at the first one's
    place: shape `T=1/16`, each other cell its values in that order. Rows whose rate cell
    lists variants of ours (`;`) or two rates (`/`) stay apart."""
    out: list[list | None] = []
    groups: dict[tuple, tuple[int, list]] = {}
    for row in rows:
        hit = _LAST_NUMBER.match(row[1])
        if not hit or ";" in row[3] or " / " in row[3]:
            out.append(row)
            continue
        key = (row[0], hit[1], row[4])
        if key not in groups:
            groups[key] = (len(out), [])
            out.append(None)
        groups[key][1].append((hit[2], row))
    for (kind, prefix, ref), (at, members) in groups.items():
        rs = [r for _, r in members]
        out[at] = rs[0] if len(rs) == 1 else [
            kind, prefix + "/".join(v for v, _ in members), *(_joined(r[i] for r in rs)
                                                             for i in (2, 3)),
            ref, *(_joined(r[i] for r in rs) for i in (5, 6)),
            " ".join(dict.fromkeys(r[7] for r in rs))]
    return out


def kernels_section(records: list[dict]) -> list[str]:
    # sampler: performance.md; moe_align (bench_moe.py: the alignment alone, per T) has no
    # shape of this table's kind, and is the fused-MoE rows' part; gemv_prefetch (a wait then
    # a read, the L2 prefetch removed after 3a391ed): performance.md
    plain = [r for r in records if "sweep" not in r["kind"] and r["kind"] not in (
        "decode_fp8kv", "sampler_step", "moe_align", "gemv_prefetch")]
    by: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in newest(plain, lambda r: (r["kind"], _shape(r), r["impl"])):
        by[(r["kind"], _shape(r))][r["impl"]] = r
    rows = []
    for (kind, shape), impls in by.items():
        ours = impls.pop("pagedserve", None) or impls.pop("triton", None)  # graphed, as served
        impls.pop("triton_eager", None)
        # other kernels of ours for the shape (pagedserve_hopper): beside ours in its rate cell
        variants = {k[len("pagedserve_"):]: impls.pop(k) for k in list(impls)
                    if k.startswith("pagedserve_")}
        ref_name, ref = next(iter(impls.items()), ("-", None))

        def rate(r: dict | None) -> str:
            return "-" if r is None else " / ".join(
                f"{r[u]:.2f} {n}" for u, n in (("tbps", "TB/s"), ("tflops", "TFLOP/s")) if u in r)
        ours_rate = "; ".join([rate(ours), *(f"{v}: {rv['ms']:.4f} ms, {rate(rv)}"
                                             for v, rv in variants.items())])
        rows.append([kind, shape, num(ours and ours["ms"], ".4f"), ours_rate, ref_name,
                     num(ref and ref["ms"], ".4f"), rate(ref), (ours or ref)["commit"]])
    rows = _merge_sizes(rows)
    sweeps = [[r["kind"], r.get("kv_cache_dtype", "bf16"), _shape(r),
               json.dumps(r["config"]) if "config" in r else
               "/".join(str(r[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M",
                                            "num_warps", "num_stages")) if "BLOCK_M" in r else
               ", ".join(f"{k} {r[k]}" for k in ("widen_to", "tile_n", "num_warps", "num_stages")),
               num(r["ms"], ".4f"), r["sweep_configs"], r["commit"], when(r)]
              for r in newest((r for r in records if "sweep" in r["kind"]
                               and r["kind"] != "moe_tune_sweep"),
                              lambda r: (r["kind"], r.get("kv_cache_dtype"), r.get("widen_to"),
                                         _shape(r)))]
    fp8 = [[f"{r['batch']} x {r['ctx']}", r["kv_cache_dtype"], num(r["ms"], ".4f"),
            num(r["tbps"], ".2f"), f"{r['speedup_vs_bf16']:.2f}x", r["commit"], when(r)]
           for r in newest((r for r in records if r["kind"] == "decode_fp8kv"
                            and not r.get("smoke")),
                           lambda r: (r["batch"], r["ctx"], r["kv_cache_dtype"]))]
    return section(
        "Kernels: newest record of each shape",
        table(["kind", "shape", "pagedserve ms", "pagedserve rate", "reference", "ms", "rate",
               "commit"], rows),
        "### Decode attention on an FP8 KV cache (`bench_fp8_kv.py`)",
        table(["batch x ctx", "kv cache", "ms", "TB/s", "vs bf16", "commit", "recorded (UTC)"],
              fp8),
        "### Config sweeps: the fastest config per shape of the newest sweep (raw grids in "
        "archive/; the fused-MoE tiles' winners are kernels/moe_configs.json)",
        table(["sweep", "kv cache", "shape", "best config", "ms", "configs timed", "commit",
               "recorded (UTC)"], sweeps))


def w4a16_section(records: list[dict]) -> list[str]:
    if not records:
        return []
    by: dict[tuple, dict[int, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in newest(records, lambda r: (r["rows"], r["n"], r["k"], r["impl"])):
        by[(r["n"], r["k"])][r["rows"]][r["impl"]] = r
    counts = sorted({m for shapes in by.values() for m in shapes})

    def cell(c: dict, impl: str) -> str:
        if impl not in c:
            return "-"
        r = c[impl]
        if impl == "torch_matmul":
            return f"{r['ms'] * 1e3:.1f}"
        text = f"{r['ms'] * 1e3:.1f} ({r['speedup_vs_bf16']:.2f}x)"
        if impl == "default" and "sweep" in c:  # the best swept config beside the default
            text += f", swept {c['sweep']['speedup_vs_bf16']:.2f}x"
        return text
    rows = [[f"{n} x {k} {label}", *(cell(shapes.get(m, {}), impl) for m in counts)]
            for (n, k), shapes in sorted(by.items())
            for impl, label in (("torch_matmul", "bf16"), ("default", "AWQ"),
                                ("default+act_order", "GPTQ act-order"))]
    floors = "; ".join(f"{n} x {k} {c['stream_floor']['ms'] * 1e3:.1f}"
                       for (n, k), shapes in sorted(by.items())
                       for m, c in sorted(shapes.items()) if "stream_floor" in c and m == 1)
    commits = sorted({r["commit"] for r in newest(records, lambda r: (
        r["rows"], r["n"], r["k"], r["impl"])) if r["impl"] != "sweep"})
    return section(
        "W4A16 GEMM (AWQ/GPTQ int4, group 128, Llama-3.1-8B shapes): microseconds by rows",
        "Newest of each shape (" + ", ".join(commits) + "), CUDA-graph replay; in brackets the "
        "speed-up over bf16 `torch.matmul` of the same run, and the best swept config's "
        "(raw grids in archive/). The int4 weights' read floor at 1 row, us: "
        + (floors or "-") + ".",
        table(["N x K", *map(str, counts)], rows))


def fp8_gemm_section(records: list[dict]) -> list[str]:
    if not records:
        return []
    by: dict[str, dict[int, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in newest(records, lambda r: (r["shape"], r["rows"], r["impl"])):
        by[f"{r['shape']} {r['n']} x {r['k']}"][r["rows"]][r["impl"]] = r
    counts = sorted({m for shapes in by.values() for m in shapes})

    def speedups(impl: str) -> list[list[str]]:
        return [[f"{shape} ({impl})", *(f"{c['bf16']['ms'] / c[impl]['ms']:.2f}x"
                                        if impl in c and "bf16" in c else "-"
                                        for c in (rows.get(m, {}) for m in counts))]
                for shape, rows in by.items()]
    first = records[-1]
    return section(
        f"FP8 GEMM: speed-up over bf16 by rows (newest of each shape; {first['commit']}, "
        f"{machine(first)})",
        "fp8: per-token activation quantization plus row-wise `torch._scaled_mm`; gemm_only: "
        "the GEMM alone.",
        table(["shape (N x K)", *map(str, counts)], speedups("fp8") + speedups("gemm_only")))


def structured_section(records: list[dict]) -> list[str]:
    rows = []
    for r in newest((r for r in records if r["constrained"]),
                    lambda r: (machine(r), r["model"], r["concurrency"])):
        plain = next((p for p in runs(records)[r["run"]] if not p["constrained"]
                      and p["concurrency"] == r["concurrency"]), None)
        if plain is None:
            continue
        rows.append([machine(r), r["model"], r["concurrency"], num(plain["tpot_p50_ms"], ".2f"),
                     num(r["tpot_p50_ms"], ".2f"),
                     f"{(r['tpot_p50_ms'] / plain['tpot_p50_ms'] - 1) * 100:+.1f} %",
                     num(r["bitmask_ms_per_step"], ".2f"),
                     num(r.get("accept_ms_per_step"), ".2f"), num(r["plan_ms_per_step"], ".2f"),
                     r["commit"], when(r)])
    return section(
        "Structured outputs: JSON-schema requests against the same run unconstrained",
        table(["machine", "model", "running", "TPOT plain ms", "TPOT JSON ms", "vs plain",
               "bitmask ms/step", "accept ms/step", "plan ms/step", "commit",
               "recorded (UTC)"], rows)) \
        if rows else []


def _spec_method(r: dict) -> str:
    """The method, its draft (a draft model's directory name) and k."""
    try:
        cfg = json.loads(r["speculative_config"])
    except (TypeError, ValueError):
        return r["method"]
    draft = f" {Path(cfg['model']).name}" if cfg.get("model") else ""
    k = cfg.get("num_speculative_tokens")
    return f"{r['method']}{draft}" + (f" k={k}" if k else "")


def spec_decode_section(records: list[dict]) -> list[str]:
    latest = newest(records, lambda r: (machine(r), r["model"], r["method"],
                                        r["speculative_config"], r.get("dtype", "auto"),
                                        r["running"]))
    real = {_spec_key(r): r for r in latest if r.get("weights") != "random"}
    rows = [[machine(r), r["model"], _spec_method(r), r.get("dtype", "auto"), r["running"],
             num(r["tpot_ms_baseline"], ".2f"),
             num(r["tpot_ms"], ".2f"),
             (f"{r['speedup']:.2f}x" if r["speedup"] else "-")
             + ("" if r["outputs_equal"] else " (outputs differ)"),
             num(r["acceptance_rate"], ".2f"), num(r["mean_accepted_tokens"], ".2f"),
             spec_projection(r, real.get(_spec_key(r))), r["commit"], when(r)]
            for r in latest]
    return section(
        "Speculative decoding: TPOT against the same flags without (input-grounded chat, greedy)",
        "Random weights keep no draft, so their rows time the drafted step alone; issue 31 reads "
        "the speedup off it at a mean accepted length (column \"read at 3\"): the step over 3 "
        "tokens, and over the length the real default model measured with the same method, k "
        "and running on that machine.",
        table(["machine", "model", "method", "dtype", "running", "TPOT without ms", "TPOT with ms",
               "speedup", "acceptance", "mean accepted", "read at 3; at the real length",
               "commit", "recorded (UTC)"], rows)) if rows else []


def spec_projection(r: dict, ref: dict | None, at: float = 3.0) -> str:
    """TPOT and speedup of a random-weight run's drafted step (TPOT x tokens a step) at `at`
    tokens a step, and at the mean accepted length of `ref` (the same method, k and running
    on the same machine with real weights); "-" for runs that kept drafts."""
    if r.get("weights") != "random" or r["acceptance_rate"] or not r["tpot_ms_baseline"]:
        return "-"
    step, base = r["tpot_ms"] * r["mean_accepted_tokens"], r["tpot_ms_baseline"]
    out = f"{step / at:.2f} ms ({base * at / step:.2f}x)"
    if ref is not None:
        n = ref["mean_accepted_tokens"]
        out += f"; {step / n:.2f} ms ({base * n / step:.2f}x) at {n:.2f}"
    return out


def _spec_key(r: dict) -> tuple:
    try:
        k = json.loads(r["speculative_config"]).get("num_speculative_tokens")
    except (TypeError, ValueError):
        k = None
    return machine(r), r["method"], k, r.get("dtype", "auto"), r["running"]


def long_context_section(records: list[dict]) -> list[str]:
    """One row per run (chunk size --long-prefill-token-threshold, and the decoders' share
    --long-prefill-decode-share where set): each prefill shape's TTFT (fraction of the bound),
    then the decoders' TPOT and ITL p99 before -> during a long prefill (records before
    2026-12-05 hold the ITL under tpot_*, and show as ITL)."""
    rows = []
    for rs in runs(records).values():
        r0 = rs[0]
        pre = ", ".join(f"{r['requests']}x{r['prompt'] // 1024}k {r['ttft_s']:.1f} s"
                        + (f" ({r['fraction']:.2f})" if r.get("fraction") else "")
                        for r in rs if r["test"] == "prefill")
        inter = next((r for r in rs if r["test"] == "interference"), None)
        during = "-"
        if inter is not None:
            # (older records hold the ITL under tpot_*)
            shown = ([("tpot", "TPOT"), ("itl", "ITL")] if "itl_p99_before_ms" in inter
                     else [("tpot", "ITL")])
            during = f"{inter['decoders']}: " + ", ".join(
                f"{label} {inter[f'{key}_p99_before_ms']:.1f} -> "
                f"{inter[f'{key}_p99_during_ms']:.1f} ms (x{inter[f'{key}_p99_ratio']:.2f})"
                for key, label in shown) + f"; short TTFT {inter['short_ttft_ms']:.0f} ms"
            if inter.get("decode_tokens"):  # decoders starting over: their TPOT p50 too
                start = "staggered " if inter.get("stagger") else ""
                during += (f"; {start}{inter['decode_tokens']}-token requests, TPOT p50 "
                           f"{inter['tpot_p50_before_ms']:.1f} -> "
                           f"{inter['tpot_p50_during_ms']:.1f} ms")
        flags = r0.get("server_flags", "")
        chunk = _flag(flags, "--long-prefill-token-threshold", "512")
        share = _flag(flags, "--long-prefill-decode-share", "0")
        rows.append([machine(r0), r0["model"], chunk + (f", share {share}" if share != "0"
                                                        else ""),
                     pre or "-", during, r0["commit"], when(r0)])
    return section(
        "Long context: prefill TTFT (fraction of the bound), decoders' p99 around it",
        table(["machine", "model", "chunk", "prefill TTFT", "decoders: p99 before -> during",
               "commit", "recorded (UTC)"], rows[-4:])) if rows else []


def lora_section(records: list[dict]) -> list[str]:
    runs = {}  # run -> (base, lora): the two halves of one call
    for r in records:
        if r["kind"] == "lora":
            runs.setdefault(r["run"], {})[r["lora"]] = r
    pairs = [(run[False], run[True]) for run in runs.values() if len(run) == 2]
    newest_pairs = {(machine(lo), lo["model"], lo["workload"], lo["adapters"], lo["rank"]):
                    (base, lo) for base, lo in pairs}  # runs are in recorded order
    rows = [[machine(lo), lo["model"], lo["workload"], lo["adapters"], lo["rank"],
             num(base["output_tok_s"], ".0f"), num(lo["output_tok_s"], ".0f"),
             num(base["tpot_p50_ms"], ".2f"), num(lo["tpot_p50_ms"], ".2f"),
             num(lo["lora_vs_base"], ".2f"), lo["commit"], when(lo)]
            for base, lo in newest_pairs.values()]
    by_tokens: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in newest((r for r in records if r["kind"] == "lora_kernel" and not r.get("smoke")),
                    lambda r: (machine(r), r["rank"], r["module"], r["tokens"])):
        by_tokens[machine(r), r["tokens"]][r["rank"], r["module"]] = r
    columns = sorted({k for cells in by_tokens.values() for k in cells},
                     key=lambda k: (k[0], ("qkv", "o", "gate_up", "down").index(k[1])))

    def cell(r: dict | None) -> str:
        return "-" if r is None else f"+{r['delta_ms'] * 1e3:.1f} ({r['base_ms'] * 1e3:.1f})"
    kern = [[m, t, "graph" if any_of["graph"] else "eager", *(cell(cells.get(c)) for c in columns),
             any_of["commit"]]
            for (m, t), cells in sorted(by_tokens.items())
            for any_of in (next(iter(cells.values())),)]
    kernel_part = [
        "### The LoRA kernels beside the projection they wrap (`bench_lora.py`, 8B shapes)",
        "Microseconds the adapters add (the projection alone), every token of the step under "
        "one of 8 adapters.",
        table(["machine", "tokens", "timed", *(f"r{r} {m}" for r, m in columns), "commit"],
              kern)] if kern else []
    return section(
        "Multi-LoRA: adapters spread over the requests against the base alone (one call)",
        table(["machine", "model", "workload", "adapters", "rank", "base tok/s", "LoRA tok/s",
               "base TPOT p50 ms", "LoRA TPOT p50 ms", "lora_vs_base", "commit",
               "recorded (UTC)"], rows), *kernel_part) if rows or kern else []


def perplexity_section(records: list[dict]) -> list[str]:
    # records before the FP8 KV cache ran over a float cache ("auto")
    rows = [[r["model"], r["method"], num(r["group_size"], "d") if r["group_size"] else "-",
             r.get("kv_cache_dtype", "auto"), num(r["ppl"], ".3f"), r["tokens"], r["commit"],
             when(r)]
            for r in newest(records, lambda r: (r["model"], r["method"], r["group_size"],
                                                r.get("kv_cache_dtype", "auto")))]
    return section("Perplexity of quantized weights and KV cache (`data/perplexity.txt`)",
                   table(["model", "method", "group", "kv cache", "ppl", "tokens", "commit",
                          "recorded (UTC)"], rows))


def _history(ax, series: dict[str, list[dict]], y: Callable[[dict], float]) -> None:
    """Each series' records at their commit, commits in the order first recorded."""
    seen = sorted({r["commit"]: r["recorded_at"] for rs in series.values()
                   for r in reversed(rs)}.items(), key=lambda kv: kv[1])
    at = {c: i for i, (c, _) in enumerate(seen)}
    for label, rs in series.items():
        if not rs:
            continue
        ax.plot([at[r["commit"]] for r in rs], [y(r) for r in rs], "o-", ms=3, label=label)
    ax.set_xticks(range(len(seen)), [c for c, _ in seen], rotation=90, fontsize=6)
    ax.legend(fontsize=6)


def _save(fig, path: Path) -> None:
    """A 64-colour PNG: a quarter of matplotlib's own size for line plots."""
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)


def plots(throughput: list[dict], serve: list[dict], out: Path) -> None:
    """PNGs of the history (PLOTS); none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed")
        return
    series: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in throughput:
        if r.get("gpu") and r["engine"] == "pagedserve" and r["workload"] in ("W1", "W2") \
                and r.get("ab") != "baseline" and r["model"].startswith("llama"):
            series[r["model"]][f"{r['workload']} {settings(r)}"].append(r)
    models = sorted(series)
    for name, y, label in (("throughput_history.png", lambda r: r["output_tok_s"],
                            "output tok/s"),
                           ("fraction_history.png", lambda r: r["roofline_fraction"],
                            "fraction of the bound")):
        fig, axes = plt.subplots(len(models), 1, figsize=(10, 4.5 * len(models)))
        for ax, model in zip(axes, models, strict=True):
            kept = {k: rs for k, rs in series[model].items() if len(rs) >= 3 and (
                "throughput" in name or not re.search(r"--quantization (?!none)", k))}
            _history(ax, kept, y)
            for (w, m), target in TARGETS.items():
                if m == model and "fraction" in name:
                    ax.axhline(target, ls=":", lw=1, color="gray")
                    ax.annotate(f"{w} target", (0, target), fontsize=6, color="gray")
            ax.set_title(f"{model}: {PLOTS[name]}", fontsize=9)
            ax.set_ylabel(label)
        _save(fig, out / name)
    w3 = [r for r in serve if r["workload"] == "W3" and r["model"] == "llama3.1-8b"
          and _serve_at_defaults(r)]
    fig, (top, low) = plt.subplots(2, 1, figsize=(8, 6))
    _history(top, {f"rate=inf, {n} requests": [r for r in w3 if r["rate"] == "inf"
                                                and r["num_requests"] == n]
                   for n in sorted({r["num_requests"] for r in w3})}, lambda r: r["output_tok_s"])
    top.axhline(W3_TARGET, ls=":", lw=1, color="gray")  # the targets at the default flags
    top.set_ylabel("output tok/s")
    top.set_title(PLOTS["w3_history.png"], fontsize=9)
    paced = [r for r in w3 if _rate(r) == "0.8 x inf's"]
    _history(low, {"TTFT p99 ms at 0.8 x inf's rate": paced}, lambda r: r["ttft_p99_ms"])
    low.axhline(150, ls=":", lw=1, color="gray")
    low.set_ylabel("TTFT p99 (ms)")
    _save(fig, out / "w3_history.png")


def report(folder: Path = RESULTS) -> str:
    """REPORT.md's text from the family files in `folder`."""
    throughput, serve, kernels = load("throughput", folder), load("serve", folder), \
        load("kernels", folder)
    lines = ["# Results", "",
             "Generated by `python -m benchmarks.report` from the JSONL files here; do not edit. "
             "Each table holds the newest record of each target; the older ones stay in the "
             "files (the history) and in the plots at the end. Raw sweeps are summarised to "
             "their best config per shape (their grids: `archive/`).", "",
             *defaults_section(throughput, serve), *throughput_section(throughput),
             *ab_section(throughput), *serve_section(serve),
             *step_overhead_section(load("step_overhead", folder)),
             *http_section(load("http", folder)), *load_section(load("load", folder)),
             *kernels_section(kernels), *w4a16_section(load("w4a16_gemm", folder)),
             *fp8_gemm_section(load("fp8_gemm", folder)),
             *structured_section(load("structured", folder)),
             *spec_decode_section(load("spec_decode", folder)),
             *lora_section(load("lora", folder)),
             *long_context_section(load("long_context", folder)),
             *perplexity_section(load("perplexity", folder)),
             "## History", "", *(f"![{title}]({name})" for name, title in PLOTS.items())]
    return "\n".join(lines) + "\n"


# Raw sweeps (a grid of kernel configs per shape) stay out of the family files: each shape's
# fastest correct config of a run stays, with how many configs were timed and how many gave
# wrong results; the raw lines go to archive/<date>_<family>_sweeps.jsonl.xz.
SWEEPS = {"w4a16_gemm": (lambda r: r.get("impl") in ("sweep", "sweep_wrong"),
                         ("run", "method", "group_size", "rows", "n", "k")),
          "kernels": (lambda r: "sweep" in r.get("kind", ""),
                      ("run", "kind", "kv_cache_dtype", "widen_to", "batch", "ctx", "q_len",
                       "shape", "rows", "tokens", "gemm"))}


def raw_sweep(family: str, rec: dict) -> bool:
    return family in SWEEPS and SWEEPS[family][0](rec) and "sweep_configs" not in rec


def _archive(folder: Path, family: str, what: str, by_date: dict[str, list[str]]) -> None:
    """Appends each day's record lines to archive/<date>_<family>_<what>.jsonl.xz."""
    for date, lines in by_date.items():
        archive = folder / "archive" / f"{date}_{family}_{what}.jsonl.xz"
        archive.parent.mkdir(exist_ok=True)
        held = lzma.decompress(archive.read_bytes()).decode() if archive.exists() else ""
        with lzma.open(archive, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
            f.write(held + "\n".join(lines) + "\n")


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
    _archive(folder, family, "sweeps", raw_by_date)

    def best(recs: list[dict]) -> str:
        ok = [r for r in recs if r.get("impl") != "sweep_wrong" and math.isfinite(r["ms"])]
        top = min(ok or recs, key=lambda r: r["ms"])
        return json.dumps({**top, "sweep_configs": len(recs), "sweep_wrong": len(recs) - len(ok),
                           "sweep_archive": f"archive/{top['recorded_at'][:10]}_{family}"
                                            "_sweeps.jsonl.xz"})
    path.write_text("".join((best(shapes[x]) if isinstance(x, tuple) else x) + "\n"
                            for x in out))
    return sum(map(len, shapes.values())) - len(shapes)


# Families whose newest record per key is all the report reads and whose superseded records
# outgrow results/' 2 MiB: `--archive-superseded` moves the older ones, by the day they were
# recorded, to archive/<date>_<family>_superseded.jsonl.xz (still there to read, out of git's
# way), keeping each key's newest record where it was.
SUPERSEDED = {"w4a16_gemm": ("method", "group_size", "rows", "n", "k", "impl")}


def archive_superseded(family: str, folder: Path = RESULTS) -> int:
    """Moves the family's records older than the newest of their key (SUPERSEDED) to the
    archive by date; returns how many it moved."""
    path = folder / f"{family}.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    recs = [json.loads(line) for line in lines]
    newest_at: dict[tuple, int] = {}
    for i, rec in enumerate(recs):  # the last written of a key is its newest
        newest_at[tuple(rec.get(f) for f in SUPERSEDED[family])] = i
    keep = set(newest_at.values())
    old_by_date: dict[str, list[str]] = defaultdict(list)
    for i, (line, rec) in enumerate(zip(lines, recs, strict=True)):
        if i not in keep:
            old_by_date[rec["recorded_at"][:10]].append(line)
    _archive(folder, family, "superseded", old_by_date)
    path.write_text("".join(line + "\n" for i, line in enumerate(lines) if i in keep))
    return len(lines) - len(keep)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summarise-sweeps", action="store_true",
                   help="collapse raw sweeps to their best config per shape first (SWEEPS)")
    p.add_argument("--archive-superseded", action="store_true",
                   help="move records older than their key's newest to archive/ (SUPERSEDED)")
    p.add_argument("--no-plots", action="store_true", help="write REPORT.md only")
    args = p.parse_args()
    for family in SWEEPS if args.summarise_sweeps else ():
        if (RESULTS / f"{family}.jsonl").exists():
            print(f"{family}: {summarise_sweeps(family)} raw sweep records archived")
    for family in SUPERSEDED if args.archive_superseded else ():
        print(f"{family}: {archive_superseded(family)} superseded records archived")
    path = RESULTS / "REPORT.md"
    path.write_text(report())
    print("wrote", path)
    if not args.no_plots:
        plots(load("throughput"), load("serve"), RESULTS)


if __name__ == "__main__":
    main()
