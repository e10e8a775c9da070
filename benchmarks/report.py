"""Tables and plots from the GPU records in benchmarks/results/ (needs matplotlib for plots:
`pip install -e ".[bench]"`).

    python -m benchmarks.report            # writes results/REPORT.md and results/*.png

Every GPU run of `benchmarks.throughput` and of `benchmarks.serve` (W3) is listed, oldest
first, so the table shows the history; the README quotes the newest rows.
"""

from __future__ import annotations

import csv
import json
import re

from benchmarks.common import RESULTS

# Measured on this H200 by the author (../shared/BENCHMARKS.md), output tok/s.
ANCHORS = {("W1", "llama3.1-8b"): "HF generate bs256 4,469; HF CB 535",
           ("W1", "llama3.2-1b"): "HF generate bs256 10,840; HF CB 1,054",
           ("W2", "llama3.1-8b"): "HF CB 483; HF static did not finish in 400 s",
           ("W2", "llama3.2-1b"): "HF static 1,163; HF CB 1,040 (1,457 tuned)"}
TARGETS = {("W1", "llama3.1-8b"): 0.8, ("W1", "llama3.2-1b"): 0.6,
           ("W2", "llama3.1-8b"): 0.7, ("W2", "llama3.2-1b"): 0.5}


def load(pattern: str) -> list[tuple[str, list[dict]]]:
    runs = []
    for path in sorted(RESULTS.glob(pattern)):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if recs and recs[0].get("gpu"):
            runs.append((path.name, recs))
    return runs


def _flag(command: str, name: str, default: str) -> str:
    m = re.search(rf"{name}[= ](\S+)", command)
    return m.group(1) if m else default


def throughput_table() -> list[str]:
    rows = ["| run | commit | workload | model | step budget | stream interval | other flags | "
            "pagedserve out tok/s | bound | fraction (target) | "
            "HF generate bs256 / HF CB, same run | "
            "per step: total = plan + executor + rest (ms) | KV token use at peak | weights GiB "
            "| KV tokens |",
            "| --- " * 15 + "|"]
    for name, recs in load("throughput_*.jsonl"):
        ours = next((r for r in recs if r["engine"] == "pagedserve"), None)
        if ours is None or not str(ours.get("model", "")).startswith("llama"):
            continue
        key = (ours["workload"], ours["model"])
        hf = next((r for r in recs if r["engine"] == "hf_generate"), None)
        cmd = ours["command"]
        flags = ours.get("server_flags", "")
        other = " ".join(f for f in re.sub(r"--stream-interval \S+", "", flags).split()) or "-"
        if "--async-scheduling" in flags and "step_ms" in ours:
            # two steps in flight: their times overlap, so they do not add up to the step
            step = f"{ours['step_ms']:.1f} (overlapped: plan {ours['plan_ms']:.1f}, executor " \
                   f"{ours['execute_ms']:.1f})"
        elif "step_ms" in ours:
            rest = ours["step_ms"] - ours["plan_ms"] - ours["execute_ms"]
            step = f"{ours['step_ms']:.1f} = {ours['plan_ms']:.1f} + " \
                   f"{ours['execute_ms']:.1f} + {rest:.1f}"
        else:
            step = ""
        weights = f"{ours['weight_gib']:.2f}" if ours.get("weight_gib") else "-"
        kv = f"{ours['kv_capacity_tokens']:,.0f}" if ours.get("kv_capacity_tokens") else "-"
        util = ours.get("kv_token_utilization_at_peak")
        cb = next((r for r in recs if r["engine"] == "hf_continuous_batching"), None)
        hf_tok = " / ".join(f"{r['output_tok_s']:,.0f}" if r else "-" for r in (hf, cb))
        rows.append(
            f"| {name.removeprefix('throughput_').removesuffix('.jsonl')} | {ours['commit']} | "
            f"{key[0]} | {key[1]} | {_flag(cmd, '--max-num-batched-tokens', '2048')} | "
            f"{_flag(flags, '--stream-interval', '1')} | {other} | "
            f"{ours['output_tok_s']:,.0f} | "
            f"{ours['bound_output_tok_s']:,.0f} | {ours['roofline_fraction']:.2f} "
            f"({TARGETS.get(key, '-')}) | {hf_tok} | "
            f"{step} | {f'{util:.3f}' if util else '-'} | {weights} | {kv} |")
    rows += ["", "Peers measured on this H200 by the issue's author (output tok/s): " + "; ".join(
        f"{w} {m}: {a}" for (w, m), a in ANCHORS.items()) + "."]
    return rows


def serve_runs() -> list[tuple[str, list[dict]]]:
    return [(n, [r for r in recs if "priority" not in r]) for n, recs in load("serve_W3_*.jsonl")]


def serve_table() -> list[str]:
    rows = ["| run | model | rate (req/s) | completed req/s | out tok/s | TTFT p50 / p99 ms | "
            "TPOT p50 / p99 ms | ITL p99 ms | goodput req/s (TTFT 250 ms, TPOT 30 ms) |",
            "| --- " * 9 + "|"]
    for name, recs in serve_runs():
        for r in recs:
            rows.append(
                f"| {name.removeprefix('serve_W3_').removesuffix('.jsonl')} | {r['model']} | "
                f"{r['rate']} | {r['request_rps']:.1f} | {r['output_tok_s']:,.0f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} / "
                f"{r['tpot_p99_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['goodput_rps']:.1f} |")
    return rows


def plots() -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: matplotlib is not installed)"]
    out = []
    runs = serve_runs()
    if runs:
        name, recs = runs[-1]
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
        ax.set_title(f"W3 {recs[0]['model']}: throughput vs rate ({name[9:-6]})")
        fig.tight_layout()
        path = RESULTS / "w3_throughput_vs_rate.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(f"![W3 throughput vs rate]({path.name})")
    # TTFT CDF from per-request dumps (benchmarks.serve --dump DIR): requests_rate*.csv
    dumps = sorted(RESULTS.glob("dumps/*/requests_rate*.csv"))
    if dumps:
        fig, ax = plt.subplots(figsize=(6, 4))
        for path in dumps:
            with path.open() as f:
                ttft = sorted(float(r["ttft_ms"]) for r in csv.DictReader(f) if not r["error"])
            if ttft:
                ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))],
                        label=f"{path.parent.name} {path.stem.removeprefix('requests_')}")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = RESULTS / "w3_ttft_cdf.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(f"![W3 TTFT CDF]({path.name})")
    else:
        out.append("(TTFT CDF: no per-request dumps yet; run benchmarks.serve with "
                   "--dump benchmarks/results/dumps/<name>)")
    return out


def main() -> None:
    lines = ["# GPU results (generated by `python -m benchmarks.report`; do not edit)", "",
             "## Offline throughput (W1, W2), through the gRPC service", "",
             *throughput_table(), "", "## Serving (W3), Poisson arrivals through gRPC", "",
             *serve_table(), "", *plots(), ""]
    path = RESULTS / "REPORT.md"
    path.write_text("\n".join(lines))
    print("wrote", path)


if __name__ == "__main__":
    main()
