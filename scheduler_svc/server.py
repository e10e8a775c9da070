"""The scheduler process: gRPC server + engine loop on one asyncio loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.config import add_step_args
from pagedserve.models import read_generation_eos, resolve_model
from protos.pagedserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_svc.engine import Engine, LinkConfig
from scheduler_svc.errors import ErrorInterceptor
from scheduler_svc.inputs import InputProcessor
from scheduler_svc.metrics import Metrics
from scheduler_svc.scheduler import SchedulerConfig
from scheduler_svc.servicer import GenerationServicer
from scheduler_svc.telemetry import Telemetry, request_log

log = logging.getLogger("pagedserve.scheduler")
# Health service names: "" is liveness (SERVING while the process runs), the API's own name is
# readiness (SERVING while a warmed-up executor is connected and the server is not draining).
LIVENESS = ""
SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's flags; defaults come through pagedserve.config (env, config file)."""
    p.add_argument("--host", default="0.0.0.0", help="bind host of the gRPC and metrics ports")
    p.add_argument("--port", type=int, default=50051, help="gRPC port of the public API")
    p.add_argument("--executor-bind", default="tcp://127.0.0.1:5557",
                   help="ZeroMQ address the executor connects to (tcp:// or ipc://)")
    p.add_argument("--metrics-port", type=int, default=8000,
                   help="Prometheus /metrics HTTP port (0 disables)")
    p.add_argument("--tokenizer", default="",
                   help="directory of the tokenizer (empty: --model's); e.g. for a config-only "
                        "directory served with --load-format random")
    p.add_argument("--served-model-name", default="",
                   help="model name in GetModelInfo and the metrics' model_name label "
                        "(empty: --model)")
    add_step_args(p)
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed message after the first (1: every token at once; "
                        "larger: fewer gRPC messages, less host work per token, for "
                        "throughput-bound batch clients)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="plan and send step N+1 before step N's result arrives (hides the "
                        "scheduler's time per step; a request that stops costs one more token "
                        "of compute)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of shared prompt prefixes")
    p.add_argument("--long-prefill-token-threshold", type=int, default=512,
                   help="most prompt tokens one request prefills per step (0: no cap)")
    p.add_argument("--priority-aging-steps", type=int, default=500,
                   help="a waiting request gains one priority level per this many steps")
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default="auto",
                   help="auto: swap victims with >= --swap-min-tokens computed tokens")
    p.add_argument("--swap-min-tokens", type=int, default=256,
                   help="in auto mode, the fewest computed tokens a victim needs to be swapped")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="queue bound; past it requests get RESOURCE_EXHAUSTED (0: none)")
    p.add_argument("--max-waiting-prompt-tokens", type=int, default=0,
                   help="bound on prompt tokens queued (0: none)")
    p.add_argument("--executor-timeout-s", type=float, default=120.0,
                   help="a step not answered within this many seconds means the executor is "
                        "lost: its requests fail with UNAVAILABLE and a new executor is awaited")
    p.add_argument("--executor-heartbeat-timeout-s", type=float, default=10.0,
                   help="an idle executor silent for this long is lost (it beats every second)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may run before they are "
                        "aborted and the process exits")
    p.add_argument("--log-prompts", action=argparse.BooleanOptionalAction, default=False,
                   help="include the prompt text in the per-request completion log")


async def serve(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    tokenizer_dir = resolve_model(args.tokenizer) if args.tokenizer else model_dir
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(tokenizer_dir))
    model_name = args.served_model_name or args.model
    metrics = Metrics(model_name)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.host)
    health_servicer = health.aio.HealthServicer()
    loop = asyncio.get_running_loop()

    pending: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def on_readiness(serving: bool) -> None:
        task = loop.create_task(health_servicer.set(SERVICE, SERVING if serving else NOT_SERVING))
        pending.add(task)
        task.add_done_callback(pending.discard)
        log.info("readiness: %s", "SERVING" if serving else "NOT_SERVING")

    engine = Engine(_scheduler_config(args), args.executor_bind, tokenizer,
                    read_generation_eos(model_dir), metrics=metrics,
                    link=LinkConfig(args.executor_timeout_s, args.executor_heartbeat_timeout_s),
                    telemetry=Telemetry(metrics, tokenizer, args.log_prompts),
                    on_readiness=on_readiness, stream_interval=args.stream_interval,
                    async_scheduling=args.async_scheduling)
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    generate_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, InputProcessor(tokenizer), model_name), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    await health_servicer.set(LIVENESS, SERVING)  # the process answers
    await health_servicer.set(SERVICE, NOT_SERVING)  # until an executor is connected
    address = f"{args.host}:{args.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"cannot bind gRPC port {address}")
    await engine.start()
    await server.start()
    log.info("gRPC listening on %s; waiting for an executor on %s", address, args.executor_bind)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await _drain(engine, args.drain_timeout_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5)  # the streams deliver their last chunk or error
    await engine.close()
    log.info("stopped")


async def _drain(engine: Engine, timeout_s: float) -> None:
    """Graceful drain: refuse new requests, give the admitted ones timeout_s to finish."""
    log.info("draining: %d requests in flight, up to %g s", len(engine.streams), timeout_s)
    engine.begin_drain()
    cut = await engine.drain(timeout_s)
    if cut:
        log.warning("drain timeout: aborted %d requests", cut)


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           long_prefill_token_threshold=args.long_prefill_token_threshold,
                           enable_prefix_caching=args.enable_prefix_caching,
                           priority_aging_steps=args.priority_aging_steps,
                           max_waiting_requests=args.max_waiting_requests,
                           max_waiting_prompt_tokens=args.max_waiting_prompt_tokens,
                           preemption_mode=args.preemption_mode,
                           swap_min_tokens=args.swap_min_tokens)


def run(args: argparse.Namespace) -> None:
    _setup_request_log()
    asyncio.run(serve(args))


def _setup_request_log() -> None:
    """Completion records go to stderr as bare JSON lines (one object each), not prefixed."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False
