"""Per-step overhead of the scheduler<->executor loop, without model compute.

The real Engine plans steps for N running decode requests and sends them over ZeroMQ to a real
executor process whose model is replaced by a stub returning fixed logits; the executor still
mirrors state, builds the batch tensors and samples. So `plan` is schedule() + protobuf
encoding, and `round trip` is send -> result (ZeroMQ both ways, executor decode, input
preparation, sampling, encode): the time a GPU step would have to hide.

    python -m benchmarks.step_overhead --running 16 64 256 [--tokenizer DIR] [--async-scheduling]
        [--curve] [--stream-interval N]

--curve runs the link with CURVE keys (made in a temporary directory): its cost per step.

`step period` is the whole loop's time per step (plan, round trip, delivering tokens to the
streams): the host's ceiling on steps per second, which a GPU step shorter than it cannot beat.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time

from benchmarks.common import write_records

VOCAB = 32


def stub_executor(address: str, num_blocks: int, block_size: int, keys: str = "") -> None:
    import torch

    from pagedserve.executor.penalties import TokenCounts
    from pagedserve.executor.runner import ModelRunner
    from pagedserve.executor.sampler import Sampler
    from pagedserve.executor.server import ExecutorServer
    from pagedserve.protos.internal.v1 import executor_pb2 as pb

    class StubModel:
        # greedy picks the last id, which decodes to text ("/" in SmolLM2's vocabulary); id 0
        # (what all-zero logits gave) is a special token that decodes to nothing, so the
        # detokenizer's window never advanced and delivery cost grew with every step
        def __call__(self, input_ids, positions, kv, meta, rows):
            logits = torch.zeros(len(rows), VOCAB)
            logits[:, -1] = 1.0
            return logits

    class StubWorker:
        runner = ModelRunner(StubModel(), [], block_size, torch.device("cpu"),
                             Sampler(torch.device("cpu")),
                             counts=TokenCounts(VOCAB, torch.device("cpu")))
        capacity = pb.Capacity(num_kv_blocks=num_blocks, block_size=block_size,
                               max_model_len=4096, vocab_size=VOCAB, dtype="none",
                               device="cpu", attention_backend="stub")

        def memory(self) -> tuple[int, int]:
            return 0, 0

    if keys:
        from pagedserve.core.link_security import load_keypair, load_public_key

        ExecutorServer(StubWorker(), address, key=load_keypair(f"{keys}/executor.key_secret"),
                       scheduler_key=load_public_key(f"{keys}/scheduler.key")).serve_forever()
    else:
        ExecutorServer(StubWorker(), address).serve_forever()


async def measure(running: int, steps: int, address: str, tokenizer: str | None = None,
                  async_scheduling: bool = False, keys: str = "", stream_interval: int = 1) -> dict:
    """keys: a directory with scheduler and executor key pairs (CURVE on the link)."""
    from pagedserve.scheduler.api.streams import OutputProcessor
    from pagedserve.scheduler.engine import Engine
    from pagedserve.scheduler.engine_client import EngineClient
    from pagedserve.scheduler.engine_io import EngineRequest
    from pagedserve.scheduler.executor_link import ExecutorLink, LinkConfig
    from pagedserve.scheduler.request import GenerationParams
    from pagedserve.scheduler.scheduler import SchedulerConfig

    class NullTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    tok = NullTokenizer()
    if tokenizer is not None:  # a real one: detokenization is part of a step's host work
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    engine = Engine(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=8192),
                    ExecutorLink(address, LinkConfig(
                        key_file=f"{keys}/scheduler.key_secret" if keys else "",
                        allowed_keys_dir=keys)), tok, eos_token_ids=[],
                    async_scheduling=async_scheduling)
    client = EngineClient(engine)
    outputs = OutputProcessor(client, tok, stream_interval)  # the front end's share of a step
    await engine.start()
    proc = mp.get_context("spawn").Process(target=stub_executor, args=(address, 65536, 16, keys),
                                           daemon=True)
    proc.start()
    await engine.wait_ready()
    params = GenerationParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    streams = []
    for i in range(running):
        req_id = await client.submit(EngineRequest(f"r{i}", [1] * 128, params))
        streams.append(outputs.open(req_id, f"r{i}", [1] * 128, params))
    for s in streams:  # wait for every request to finish
        while not (await s.queue.get()).finish_reason:
            pass
    wall = time.perf_counter() - start
    timings = engine.telemetry.timings
    decode = [t for t in timings if t.num_reqs == running and t.num_tokens == running]
    proc.terminate()
    await engine.close()
    plan = [t.plan_s * 1e6 for t in decode]
    rtt = [t.round_trip_s * 1e6 for t in decode]
    return {"kind": "step_overhead", "running": running, "steps": len(decode),
            "plan_us_p50": statistics.median(plan), "plan_us_mean": statistics.fmean(plan),
            "round_trip_us_p50": statistics.median(rtt),
            "round_trip_us_mean": statistics.fmean(rtt),
            "executor_us_p50": statistics.median(t.execute_s * 1e6 for t in decode),
            # the whole loop with a model that takes no time: the host's ceiling on steps/s
            "step_period_us": wall * 1e6 / len(timings),
            "tokenizer": "null" if tokenizer is None else tokenizer,
            "async_scheduling": async_scheduling, "curve": bool(keys),
            "stream_interval": stream_interval}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--running", type=int, nargs="+", default=[16, 64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--address", default="ipc:///tmp/pagedserve-bench-overhead")
    p.add_argument("--tokenizer", default=None,
                   help="detokenize with this tokenizer (a model directory); default: none")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--curve", action="store_true", help="CURVE keys on the executor link")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed message after the first (the throughput runs use 8)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as keys:
        if args.curve:
            from pagedserve.core.link_security import create_keypair

            create_keypair(keys, "scheduler")
            create_keypair(keys, "executor")
        records = [asyncio.run(measure(n, args.steps, args.address, args.tokenizer,
                                       args.async_scheduling, keys if args.curve else "",
                                       args.stream_interval))
                   for n in args.running]
    print(f"{'running':>8} {'plan p50 us':>12} {'round trip p50 us':>18} {'executor p50 us':>16} "
          f"{'step period us':>15}")
    for r in records:
        print(f"{r['running']:>8} {r['plan_us_p50']:>12.0f} {r['round_trip_us_p50']:>18.0f} "
              f"{r['executor_us_p50']:>16.0f} {r['step_period_us']:>15.0f}")
    print("appended to", write_records("step_overhead", records))


if __name__ == "__main__":
    main()
