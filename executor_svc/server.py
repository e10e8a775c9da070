"""The executor process: connects to the scheduler over ZeroMQ and runs the steps it plans."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import time
import traceback
import uuid

import zmq

from executor_svc.jit_watch import JitWatch
from executor_svc.profiling import StepProfiler
from executor_svc.runner import Launched
from executor_svc.worker import ExecutorConfig, Worker
from pagedserve.config import add_step_args
from protos.pagedserve.internal.v1 import executor_pb2 as pb

log = logging.getLogger("pagedserve.executor")
HELLO_INTERVAL_S = 1.0  # resend hello until welcomed, and as a heartbeat while idle


class ExecutorServer:
    def __init__(self, worker: Worker, scheduler_address: str,
                 profiler: StepProfiler | None = None) -> None:
        self.worker = worker
        self.profiler = profiler
        self.executor_id = uuid.uuid4().hex
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(scheduler_address)
        self.stopping = False

    def _hello(self, heartbeat: bool) -> None:
        hello = pb.Hello(capacity=self.worker.capacity, executor_id=self.executor_id,
                         heartbeat=heartbeat)
        self.sock.send(pb.ExecutorMessage(hello=hello).SerializeToString())

    def serve_forever(self) -> None:
        welcomed = False
        # A launched step whose tokens are not read yet: its result goes out once the next plan
        # (if one is already waiting: async scheduling) has been launched behind it, so the
        # device never waits for this process to build the next step's inputs.
        launched: tuple[int, Launched, float] | None = None
        self._hello(heartbeat=False)
        while not self.stopping:
            if not self.sock.poll(0 if launched else int(HELLO_INTERVAL_S * 1000)):
                if launched is not None:
                    self._send(self._finish(*launched))
                    launched = None
                else:
                    self._hello(heartbeat=welcomed)
                continue
            with self._phase("recv"):
                msg = pb.SchedulerMessage.FromString(self.sock.recv())
            kind = msg.WhichOneof("kind")
            if kind == "welcome":
                launched = None  # a new scheduler session: whatever ran is forgotten
                self.worker.runner.reset()
                welcomed = True
                log.info("joined scheduler")
            elif kind == "plan":
                plan, start = msg.plan, time.perf_counter()
                if self.profiler is not None:
                    self.profiler.step()
                try:
                    with self._phase("launch"):
                        nxt = self.worker.runner.launch(plan)
                except Exception as e:  # report, keep serving: the scheduler aborts the step
                    if launched is not None:
                        self._send(self._finish(*launched))
                        launched = None
                    self._send(self._failed(plan.step_id, e))
                    continue
                if launched is not None:
                    self._send(self._finish(*launched))
                launched = None
                if nxt is None:  # nothing samples (prefill chunks only): answer at once
                    self._send(self._result(plan.step_id, [], [], start, graphed=False))
                else:
                    launched = (plan.step_id, nxt, start)
        self.sock.close()

    def _send(self, result: pb.StepResult) -> None:
        with self._phase("send"):
            self.sock.send(pb.ExecutorMessage(result=result).SerializeToString())

    def _phase(self, name: str) -> contextlib.AbstractContextManager:
        return self.profiler.phase(name) if self.profiler is not None else contextlib.nullcontext()

    def _finish(self, step_id: int, launched: Launched, start: float) -> pb.StepResult:
        try:
            with self._phase("finish"):
                req_ids, tokens = self.worker.runner.finish(launched)
        except Exception as e:
            return self._failed(step_id, e)
        return self._result(step_id, req_ids, tokens, start, launched.graphed)

    @staticmethod
    def _failed(step_id: int, e: Exception) -> pb.StepResult:
        log.error("step %d failed:\n%s", step_id, traceback.format_exc())
        return pb.StepResult(step_id=step_id, error=f"{type(e).__name__}: {e}")

    def _result(self, step_id: int, req_ids: list[int], tokens: list[int], start: float,
                graphed: bool) -> pb.StepResult:
        used, total = self.worker.memory()
        return pb.StepResult(step_id=step_id, req_ids=req_ids, sampled_token_ids=tokens,
                             execute_seconds=time.perf_counter() - start,
                             device_memory_used_bytes=used, device_memory_total_bytes=total,
                             execution_mode=pb.EXECUTION_MODE_CUDA_GRAPH if graphed
                             else pb.EXECUTION_MODE_EAGER)


def add_args(p: argparse.ArgumentParser) -> None:
    """The executor's flags; defaults come through pagedserve.config (env, config file)."""
    p.add_argument("--scheduler-address", default="tcp://127.0.0.1:5557",
                   help="ZeroMQ address the scheduler binds (its --executor-bind)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:1; auto: CUDA when present")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16 or float16; auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="longest prompt + completion (0: the model's; capped by the KV cache)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV-cache budget on the CPU, GiB")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="exact number of KV blocks (overrides the memory budgets; 0: derive)")
    p.add_argument("--swap-space-gib", "--swap-space", dest="swap_space_gib", type=float,
                   default=4.0,
                   help="host memory for KV blocks of requests preempted by swap, GiB (0: none); "
                        "--swap-space / swap_space is vLLM's name")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU this process may use (CUDA)")
    p.add_argument("--load-format", choices=["auto", "random"], default="auto",
                   help="random: random weights for the model's config (benchmarks)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: triton on CUDA, torch on CPU")
    p.add_argument("--quantization", choices=["auto", "none", "awq", "gptq"], default="auto",
                   help="4-bit weights; auto: from config.json's quantization_config")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="CUDA: run every step eagerly instead of replaying captured CUDA graphs "
                        "for decode steps")
    p.add_argument("--torch-profile-dir", default="",
                   help="record a torch profiler trace of --torch-profile-steps steps here "
                        "(Chrome trace and an op table; empty: off)")
    p.add_argument("--torch-profile-steps", default="40:4",
                   help="START:COUNT[,START:COUNT...]: the steps to profile, counted from the "
                        "first plan")
    add_step_args(p)


def run(args: argparse.Namespace) -> None:
    from pagedserve.models import resolve_model

    cfg = ExecutorConfig(
        model=str(resolve_model(args.model)), load_format=args.load_format, device=args.device,
        dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)), num_kv_blocks=args.num_kv_blocks,
        swap_space_bytes=int(args.swap_space_gib * (1 << 30)),
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend, quantization=args.quantization,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
    )
    worker = Worker(cfg)
    worker.warm_up()
    if worker.device.type == "cuda":
        JitWatch().install()
    profiler = (StepProfiler(args.torch_profile_dir, args.torch_profile_steps)
                if args.torch_profile_dir else None)
    server = ExecutorServer(worker, args.scheduler_address, profiler)

    def stop(*_: object) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("executor %s connecting to %s", server.executor_id, args.scheduler_address)
    server.serve_forever()
