"""The scheduler process: gRPC server + engine loop on one asyncio loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.models import read_generation_eos, resolve_model
from protos.pagedserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_svc.engine import Engine
from scheduler_svc.errors import ErrorInterceptor
from scheduler_svc.inputs import InputProcessor
from scheduler_svc.metrics import Metrics
from scheduler_svc.scheduler import SchedulerConfig
from scheduler_svc.servicer import GenerationServicer

log = logging.getLogger("pagedserve.scheduler")
SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def add_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--host", default=env("PAGEDSERVE_HOST", "0.0.0.0"), help="gRPC bind host")
    p.add_argument("--port", type=int, default=int(env("PAGEDSERVE_PORT", "50051")))
    p.add_argument("--executor-bind", default=env("PAGEDSERVE_EXECUTOR_BIND",
                                                  "tcp://127.0.0.1:5557"),
                   help="ZeroMQ address the executor connects to")
    p.add_argument("--metrics-port", type=int,
                   default=int(env("PAGEDSERVE_METRICS_PORT", "9400")),
                   help="Prometheus /metrics HTTP port (0 disables)")
    p.add_argument("--max-num-seqs", type=int, default=int(env("PAGEDSERVE_MAX_NUM_SEQS", "128")))
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=int(env("PAGEDSERVE_MAX_NUM_BATCHED_TOKENS", "2048")))
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env("PAGEDSERVE_ENABLE_PREFIX_CACHING", "1") not in ("0", "false"),
                   help="reuse the KV blocks of shared prompt prefixes (default on)")
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=int(env("PAGEDSERVE_LONG_PREFILL_TOKEN_THRESHOLD", "512")),
                   help="most prompt tokens one request prefills per step (0: no cap)")
    p.add_argument("--priority-aging-steps", type=int,
                   default=int(env("PAGEDSERVE_PRIORITY_AGING_STEPS", "500")),
                   help="a waiting request gains one priority level per this many steps")
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"],
                   default=env("PAGEDSERVE_PREEMPTION_MODE", "auto"),
                   help="auto: swap victims with >= --swap-min-tokens computed tokens")
    p.add_argument("--swap-min-tokens", type=int,
                   default=int(env("PAGEDSERVE_SWAP_MIN_TOKENS", "256")))
    p.add_argument("--max-waiting-requests", type=int,
                   default=int(env("PAGEDSERVE_MAX_WAITING_REQUESTS", "1024")),
                   help="queue bound; past it requests get RESOURCE_EXHAUSTED (0: none)")
    p.add_argument("--max-waiting-prompt-tokens", type=int,
                   default=int(env("PAGEDSERVE_MAX_WAITING_PROMPT_TOKENS", "0")),
                   help="bound on prompt tokens queued (0: none)")


async def serve(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_dir))
    cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          enable_prefix_caching=args.enable_prefix_caching,
                          priority_aging_steps=args.priority_aging_steps,
                          max_waiting_requests=args.max_waiting_requests,
                          max_waiting_prompt_tokens=args.max_waiting_prompt_tokens,
                          preemption_mode=args.preemption_mode,
                          swap_min_tokens=args.swap_min_tokens)
    metrics = Metrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.host)
    engine = Engine(cfg, args.executor_bind, tokenizer, read_generation_eos(model_dir),
                    metrics=metrics)
    await engine.start()

    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    generate_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, InputProcessor(tokenizer), args.model), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{args.host}:{args.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"cannot bind gRPC port {address}")
    await server.start()
    log.info("gRPC listening on %s; waiting for an executor on %s", address, args.executor_bind)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def mark_serving() -> None:
        await engine.wait_ready()
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving")

    ready_task = asyncio.create_task(mark_serving())
    await stop.wait()
    log.info("shutting down")
    ready_task.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5)
    await engine.close()


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
