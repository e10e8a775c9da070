"""Result records shared by every benchmark (schema: ../shared/BENCHMARKS.md).

benchmarks/results/ keeps one append-only JSONL per family (`throughput.jsonl`, `serve.jsonl`,
`step_overhead.jsonl`, `load.jsonl`, `kernels.jsonl`, `w4a16_gemm.jsonl`, `perplexity.jsonl`),
oldest record first. Every record carries the environment (`commit`, `gpu`, `torch`, `triton`,
`command`), `recorded_at` (UTC) and `run`: `<family>_<time>`, shared by the records of one
invocation.

`PAGEDSERVE_RESULTS=DIR` makes the benchmarks append to DIR/<family>.jsonl instead (a scratch
folder on the device machine); their records join the families here with

    python -m benchmarks.common add [--set KEY=VALUE ...] FILE...

which also takes the per-run files older harnesses write (`throughput_2026-11-30T010026.jsonl`,
`kernels_2026-11-29_run1.jsonl`: the family, time and run come from the name).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from pagedserve.scheduler.metrics import EXECUTOR_PHASES, LOOP_PHASES

RESULTS = Path(__file__).resolve().parent / "results"
# family_2026-11-30T010026[_label].jsonl, family_2026-11-29_run1.jsonl
_PER_RUN = re.compile(r"(?P<family>.+?)_(?P<date>\d{4}-\d{2}-\d{2})(?:T(?P<time>\d{6}))?"
                      r"(?:_.*)?$")


def model_flags(model: str, load_format: str, tokenizer: str = "") -> list[str]:
    """`pagedserve serve`'s flags for the model a benchmark serves (tokenizer: a directory, for
    config-only models with random weights)."""
    return ["--model", model, "--load-format", load_format,
            *(["--tokenizer", tokenizer] if tokenizer else [])]


def step_breakdown(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """Where a step's time went between two scrapes of the service's metrics.

    wall / steps = plan + round trip + the rest (delivering tokens to streams, gRPC writes);
    round trip = executor time + the link. Then each process's time per step by phase, and the
    device's busy time and gaps (CUDA): what bounds a host-bound run.
    """
    def delta(key, prefix="pagedserve_"):
        return after.get(prefix + key, 0) - before.get(prefix + key, 0)

    def steps(mode):
        return delta(f'executor_steps_total{{mode="{mode}"}}')

    def mean_ms(hist):
        return 1e3 * delta(f"{hist}_sum") / max(1, delta(f"{hist}_count"))

    n = max(1, steps("cuda_graph") + steps("eager"))

    def per_step_ms(family, label, values):
        return {v: round(1e3 * delta(f'{family}_seconds_total{{{label}="{v}"}}') / n, 4)
                for v in values}

    loop = per_step_ms("scheduler_loop", "phase", LOOP_PHASES)
    return {"graph_steps": steps("cuda_graph"), "eager_steps": steps("eager"),
            "step_ms": 1e3 * wall / n,
            # tokens a step (a running request planned in every step gives one): fewer than
            # the running requests means some sat steps out; and the loop's time a step in none
            # of its phases (waiting with nothing in flight, or outside the loop's accounting)
            "tokens_per_step": delta("generation_tokens_total") / n,
            "loop_unaccounted_ms": round(1e3 * wall / n - sum(loop.values()), 4),
            "plan_ms": mean_ms("scheduler_plan_seconds"),
            "round_trip_ms": mean_ms("step_round_trip_seconds"),
            "execute_ms": mean_ms("executor_step_seconds"),
            # per step, where each process's time went (pagedserve_*_seconds_total by phase)
            "scheduler_loop_ms": loop,
            "executor_host_ms": per_step_ms("executor_host", "phase", EXECUTOR_PHASES),
            "device_ms": per_step_ms("executor_device", "state", ("busy", "gap")),
            # CPU time per step of each process (every thread): near step_ms, it is saturated
            # scheduler: the engine core's alone when API processes run beside it (api: theirs)
            "cpu_ms": {"scheduler": round(1e3 * delta("process_cpu_seconds_total", "") / n, 4),
                       "api": round(1e3 * delta("api_process_cpu_seconds_total") / n, 4),
                       "executor": round(1e3 * delta("executor_cpu_seconds_total") / n, 4)}}


def step_split(r: dict | None) -> str:
    """A run's step-time breakdown in one cell (common.step_breakdown's fields)."""
    if not r or "step_ms" not in r:
        return "-"
    head = f"{r['step_ms']:.1f}"
    if "device_ms" not in r:
        return (f"{head}: plan {r['plan_ms']:.2f}, round trip {r['round_trip_ms']:.1f}, "
                f"executor {r['execute_ms']:.1f}")

    def parts(d: dict, keep: float = 0.05) -> str:
        return " ".join(f"{k} {v:.2f}" for k, v in d.items() if v >= keep)

    out = [head]
    if "tokens_per_step" in r:
        out[0] += (f" ({r['tokens_per_step']:.1f} tokens a step, "
                   f"{r['loop_unaccounted_ms']:.2f} ms outside the loop's phases)")
    if any(r["device_ms"].values()):
        out.append(f"device {parts(r['device_ms'], 0)}")
    if "cpu_ms" in r:
        out.append(f"cpu {parts(r['cpu_ms'])}")
    return "; ".join([*out, f"scheduler {parts(r['scheduler_loop_ms'])}",
                      f"executor {parts(r['executor_host_ms'])}"])


def step_bounds(log_text: str) -> dict:
    """The step bounds the executor settled on (flags or by device), from its log line."""
    m = re.search(r"step bounds: (\d+) sequences, (\d+) tokens", log_text)
    return {"max_num_seqs": int(m[1]), "max_num_batched_tokens": int(m[2])} if m else {}


def results_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_RESULTS") or RESULTS)


ENV_SWITCHES = ("PAGEDSERVE_MOE_FUSE_SILU",  # kernels/fused_moe.py: SiLU in GEMM 1's epilogue
                "PAGEDSERVE_MOE_FUSE_ROUTE",  # kernels/fused_moe.py: routing and alignment fused
                "PAGEDSERVE_MOE_DECODE_TOKENS",  # kernels/fused_moe.py: moe_decode's GEMVs
                "PAGEDSERVE_DENSE_GEMV_ROWS",  # executor_svc/layers.py: kernels/gemv.py's rows
                "PAGEDSERVE_DENSE_GEMV_MAX_MIB",  # and the largest weight it takes
                "PAGEDSERVE_DENSE_GEMV_BLOCK",  # and its tiles (unset: gemv.dense_tiles)
                "PAGEDSERVE_PREFILL_KERNEL",  # "hopper": kernels/paged_prefill_hopper.py
                "PAGEDSERVE_LATENT_EXPAND_ROWS",  # executor_svc/layers.py: expanded prompts
                "PAGEDSERVE_LATENT_EXPAND_TOKENS")  # and the contexts a step expands


def switches() -> dict:
    """What each of ENV_SWITCHES is in effect here, defaults included, as the service started
    from this environment reads them: a record from before a default changed reads apart
    from one after (`env` names only the switches set)."""
    from pagedserve.executor import layers
    from pagedserve.kernels import fused_moe, paged_prefill_hopper

    return {"moe_fuse_silu_tokens": fused_moe.FUSE_SILU_TOKENS,
            "moe_fuse_route": fused_moe.FUSE_ROUTE,
            "moe_decode_tokens": fused_moe.DECODE_TOKENS,
            "dense_gemv_rows": layers.GEMV_ROWS,
            "dense_gemv_max_mib": layers.GEMV_MAX_BYTES / 2**20,
            "dense_gemv_block": "x".join(map(str, layers.GEMV_BLOCK)) if layers.GEMV_BLOCK
            else "dense_tiles",
            "prefill_kernel": os.environ.get(paged_prefill_hopper.ENV) or "auto",
            "latent_expand_rows": layers.LATENT_EXPAND_ROWS,
            "latent_expand_tokens": layers.LATENT_EXPAND_TOKENS}


def environment() -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = os.environ.get("PAGEDSERVE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=RESULTS.parent).stdout.strip()  # the device machine gets no .git: pass it in
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    # switches the service reads from the environment, not its flags: an A/B of one in a call
    # tells its records apart by them (named one by one: the environment may hold keys)
    env = {k: os.environ[k] for k in ENV_SWITCHES if k in os.environ}
    return {"commit": commit, "gpu": gpu, "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "triton": triton_version,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            **({"env": env} if env else {}), "switches": switches()}


def append(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


class AboveTheBound(ValueError):
    """A throughput above the run's own lower bound on time: a measurement that skipped work
    (a prefix cached by the warm-up, a bound for the wrong dtype), never a record."""


def check_bound(record: dict) -> None:
    tok_s, bound = record.get("output_tok_s"), record.get("bound_output_tok_s")
    if tok_s is not None and bound and tok_s > bound:
        basis = {k: v for k, v in record.items() if k.startswith("bound_")}
        raise AboveTheBound(f"{record.get('engine')} {record.get('workload')}: {tok_s:.0f} out "
                            f"tok/s is above its bound ({basis}): not recorded")


def write_records(family: str, records: list[dict]) -> Path:
    """Append this run's records to the family's file (results_dir()/<family>.jsonl); a
    throughput above its bound refuses the whole run (check_bound)."""
    for r in records:
        check_bound(r)
    now = time.gmtime()
    stamp = {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
             "run": f"{family}_{time.strftime('%Y-%m-%dT%H%M%S', now)}"}
    env = environment()
    return append(results_dir() / f"{family}.jsonl", [{**stamp, **env, **r} for r in records])


def read(path: Path) -> list[dict]:
    """The records of a .jsonl file (one per line) or a .json file (a list)."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def family_of(path: Path) -> tuple[str, str | None, str]:
    """(family, recorded_at, run) from a file name: a family file (`serve.jsonl`: no time) or
    a per-run file, whose name stem is the run and whose time is UTC."""
    m = _PER_RUN.fullmatch(path.stem)
    if m is None:
        return path.stem, None, path.stem
    family = "serve" if m["family"].startswith("serve_") else m["family"]  # serve_<workload>
    if family == "cpu_throughput":  # its records say device "cpu"
        family = "throughput"
    t = m["time"]
    return family, m["date"] + (f"T{t[:2]}:{t[2:4]}:{t[4:]}Z" if t else ""), path.stem


def add(paths: list[Path], into: Path, extra: dict) -> dict[str, int]:
    """Append the records of `paths` to their families under `into`, in time order; a run the
    family already holds is skipped (adding the same bundle twice changes nothing)."""
    batches: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        family, recorded_at, run = family_of(path)
        mtime = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(path.stat().st_mtime))
        for rec in read(path):
            batches[family].append({"recorded_at": recorded_at or mtime, "run": run,
                                    **rec, **extra})
    added = {}
    for family, recs in batches.items():
        target = into / f"{family}.jsonl"
        held = {r.get("run") for r in read(target)} if target.exists() else set()
        new = [r for r in recs if r["run"] not in held]
        for run in sorted({r["run"] for r in recs} & held):
            print(f"{family}: {run} is already there, skipped", file=sys.stderr)
        new.sort(key=lambda r: r["recorded_at"])  # stable: a run keeps its own order
        append(target, new)
        added[family] = len(new)
    return added


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    p = argparse.ArgumentParser(description="append records to their families")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="append the records of these files to their families")
    a.add_argument("files", nargs="+", type=Path)
    a.add_argument("--into", type=Path, default=None,
                   help="the families' folder (default: $PAGEDSERVE_RESULTS or results/)")
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="add this field to every record (a JSON value or a string)")
    args = p.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.set)
    added = add(args.files, args.into or results_dir(), {k: _value(v) for k, v in extra.items()})
    for family, n in added.items():
        print(f"{family}: {n} records added")


if __name__ == "__main__":
    main()
