"""Load and soak benchmark on the CPU default model, through the real gRPC API (not in CI).

Three phases against one `pagedserve serve`, with the resident memory of the scheduler and the
executor sampled every --sample-s seconds throughout:

  burst  --streams concurrent streams sent at once (text prompts of varied length, tokenized and
         detokenized by the server), every one expected to complete;
  stall  a 120-token stream alone, then beside --stall-prompts text prompts just under the byte
         limit (tokenized while it streams) and as many just over it (refused before
         tokenizing): how much the big ones slow the small one (its time, its longest gap);
  soak   --clients concurrent clients sending requests back to back for --soak-minutes: 70 %
         run to the end, 15 % are cancelled by the client at a random moment, 15 % carry a
         deadline of 0.5-3 s.

Reports completions by status and p50/p99 latency per phase, the memory of both processes at the
phase boundaries and at the end, KV blocks left allocated when idle (must be 0), one record in
benchmarks/results/load.jsonl and the memory plot benchmarks/results/load_memory.png.

    python -m benchmarks.load --streams 1024 --soak-minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from benchmarks.common import RESULTS, write_records
from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2_grpc

WORDS = ["the", "river", "city", "night", "light", "story", "market", "winter", "garden",
         "machine", "signal", "forest", "harbor", "letter", "mountain", "engine", "window",
         "season", "bridge", "voice"]


@dataclass
class Outcome:
    status: str = "OK"
    ttft: float = math.nan
    e2el: float = math.nan
    tokens: int = 0
    max_gap: float = 0.0


@dataclass
class Memory:
    """Resident memory of serve's children, sampled by a thread."""

    pids: dict[str, int]
    every: float
    samples: list[tuple[float, str, dict[str, int]]] = field(default_factory=list)
    phase: str = "start"
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.t0 = time.monotonic()
        threading.Thread(target=self._run, daemon=True).start()

    def sample(self) -> dict[str, int]:
        import psutil

        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                out[name] = 0
        self.samples.append((time.monotonic() - self.t0, self.phase, out))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


def text_prompt(rng: random.Random, words: int) -> str:
    return f"Story {rng.randrange(10**6)}: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one(stub, req, timeout: float | None, cancel_after: float | None = None) -> Outcome:
    out = Outcome()
    sent = last = time.perf_counter()
    call = stub.Generate(req, timeout=timeout)
    if cancel_after is not None:
        asyncio.get_running_loop().call_later(cancel_after, call.cancel)
    try:
        async for chunk in call:
            now = time.perf_counter()
            if math.isnan(out.ttft):
                out.ttft = now - sent
            else:
                out.max_gap = max(out.max_gap, now - last)
            last = now
            out.tokens += len(chunk.token_ids)
        out.e2el = last - sent
    except asyncio.CancelledError:
        out.status = "CANCELLED"
    except grpc.aio.AioRpcError as e:
        out.status = e.code().name
    return out


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)) * 1e3, 1) if xs else math.nan


def summary(outcomes: list[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if o.status == "OK"]
    return {"requests": len(outcomes), "by_status": dict(Counter(o.status for o in outcomes)),
            "wall_s": round(wall, 1), "output_tok_s": round(sum(o.tokens for o in ok) / wall, 1),
            "ttft_p50_ms": pct([o.ttft for o in ok], 50),
            "ttft_p99_ms": pct([o.ttft for o in ok], 99),
            "e2el_p50_ms": pct([o.e2el for o in ok], 50),
            "e2el_p99_ms": pct([o.e2el for o in ok], 99)}


async def burst(address: str, streams: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        reqs = [build_request(text=text_prompt(rng, rng.randint(4, 200)), max_tokens=max_tokens,
                              temperature=0.8, seed=i, ignore_eos=True) for i in range(streams)]
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(stub, r, timeout=3600) for r in reqs))
        return summary(outcomes, time.perf_counter() - start)


async def stall(address: str, big: int, limit_bytes: int, seed: int) -> dict:
    rng = random.Random(seed)
    probe = build_request(text="Count to one hundred:", max_tokens=120, temperature=0,
                          ignore_eos=True)

    def huge(size: int) -> str:
        text = ""
        while len(text) < size:
            text += text_prompt(rng, 2000) + " "
        return text[:size]

    async with grpc.aio.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        await one(stub, probe, 600)  # warm
        alone = await one(stub, probe, 600)
        under = [build_request(text=huge(limit_bytes - 64), max_tokens=1) for _ in range(big)]
        over = [build_request(text=huge(limit_bytes + 64), max_tokens=1) for _ in range(big)]
        probe_task = asyncio.create_task(one(stub, probe, 600))
        await asyncio.sleep(0.3)  # streaming when the big ones arrive
        t = time.perf_counter()
        bigs = await asyncio.gather(*(one(stub, r, 600) for r in under + over))
        big_wall = time.perf_counter() - t
        beside = await probe_task
    return {"limit_bytes": limit_bytes, "big_prompts": 2 * big,
            "under_by_status": dict(Counter(o.status for o in bigs[:big])),
            "over_by_status": dict(Counter(o.status for o in bigs[big:])),
            "big_wall_s": round(big_wall, 2),
            "probe_alone_s": round(alone.e2el, 2), "probe_alone_max_gap_ms": round(
                alone.max_gap * 1e3, 1),
            "probe_beside_s": round(beside.e2el, 2), "probe_beside_max_gap_ms": round(
                beside.max_gap * 1e3, 1), "probe_beside_status": beside.status}


async def soak(address: str, clients: int, minutes: float, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    kinds: Counter = Counter()
    end = time.monotonic() + minutes * 60

    async def client(stub) -> None:
        while time.monotonic() < end:
            kind = rng.choices(["full", "cancel", "deadline"], [70, 15, 15])[0]
            kinds[kind] += 1
            req = build_request(text=text_prompt(rng, rng.randint(4, 300)),
                                max_tokens=rng.randint(8, 128), temperature=0.8,
                                seed=rng.randrange(2**63), ignore_eos=rng.random() < 0.5)
            outcomes.append(await one(
                stub, req, timeout=rng.uniform(0.5, 3.0) if kind == "deadline" else 600,
                cancel_after=rng.uniform(0.0, 2.0) if kind == "cancel" else None))

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(client(stub) for _ in range(clients)))
        return {**summary(outcomes, time.perf_counter() - start), "kinds": dict(kinds)}


def plot(mem: Memory, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ts = [t / 60 for t, _, _ in mem.samples]
    for name in mem.pids:
        ax.plot(ts, [s[name] / 2**20 for _, _, s in mem.samples], label=name)
    last, top, n = None, ax.get_ylim()[1], 0
    for t, phase, _ in mem.samples:
        if phase != last:  # labels alternate in height: short phases sit close together
            ax.axvline(t / 60, color="grey", lw=0.5)
            ax.text(t / 60, top * (0.98 - 0.06 * (n % 2)), f" {phase}", va="top", fontsize=8)
            last, n = phase, n + 1
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory, MiB")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    import psutil

    from tests.integration.service import Service

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=1024, help="concurrent streams of the burst")
    p.add_argument("--burst-max-tokens", type=int, default=32)
    p.add_argument("--stall-prompts", type=int, default=3,
                   help="big prompts under the byte limit (and as many over it)")
    p.add_argument("--clients", type=int, default=48, help="concurrent clients of the soak")
    p.add_argument("--soak-minutes", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=5.0, help="memory sampling period")
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra flag for pagedserve serve (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=str(RESULTS / "load_memory.png"))
    args = p.parse_args()

    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", "--max-num-seqs", "256",
                  *args.server_flag)
    try:
        svc.wait_serving(timeout=600)
        children = psutil.Process(svc.proc.pid).children()
        pids = {name: next(c.pid for c in children if name in c.cmdline())
                for name in ("scheduler", "executor")}
        mem = Memory(pids, args.sample_s)
        mem.start()
        rec: dict = {"model": "default", "cpu_count": psutil.cpu_count(),
                     "server_flags": " ".join(["--max-num-seqs", "256", *args.server_flag])}
        marks = {"start": mem.sample()}
        phases = (("burst", lambda: burst(svc.address, args.streams, args.burst_max_tokens,
                                          args.seed)),
                  ("stall", lambda: stall(svc.address, args.stall_prompts,
                                          _byte_limit(svc), args.seed)),
                  ("soak", lambda: soak(svc.address, args.clients, args.soak_minutes,
                                        args.seed)))
        for name, run in phases:
            mem.phase = name
            load_before = psutil.getloadavg()[0]
            rec[name] = asyncio.run(run())
            rec[name]["load_avg_1m_before"] = round(load_before, 2)
            idle = svc.wait_idle(timeout=60)
            rec[name]["kv_blocks_in_use_after"] = int(
                idle["pagedserve_num_kv_blocks"] - idle["pagedserve_num_free_kv_blocks"])
            marks[f"after_{name}"] = mem.sample()
            print(name, json.dumps(rec[name]), flush=True)
        mem.phase = "idle"
        time.sleep(30)
        marks["idle_30s"] = mem.sample()
        mem.stop()
        rec["rss_mib"] = {k: {n: round(v / 2**20) for n, v in m.items()} for k, m in
                          marks.items()}
        rec["rss_peak_mib"] = {n: round(max(s[n] for _, _, s in mem.samples) / 2**20)
                               for n in pids}
        print("memory", json.dumps(rec["rss_mib"]), "peak", rec["rss_peak_mib"], flush=True)
        plot(mem, Path(args.plot), f"pagedserve serve, CPU default model: {args.streams} "
             f"streams, stall probe, {args.soak_minutes:g}-min soak of {args.clients} clients")
    finally:
        svc.stop()
    print("appended to", write_records("load", [rec]))


def _byte_limit(svc) -> int:
    """The server's byte limit on text input, as its refusal of a 3 MB prompt states it
    ("text: N bytes, more than the LIMIT a prompt may have")."""
    size = 3_000_000  # under gRPC's 4 MiB message limit
    try:
        svc.client.complete(text="x" * size, max_tokens=1)
    except grpc.RpcError as e:
        return min(int(w) for w in e.details().split() if w.isdigit() and int(w) < size)
    raise AssertionError(f"a {size}-byte prompt was accepted")


if __name__ == "__main__":
    main()
