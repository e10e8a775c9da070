"""The scheduler process: gRPC server + engine loop on one asyncio loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import disable_created_metrics

from pagedserve.core.collector import freeze_long_lived
from pagedserve.core.link_security import (
    LinkSecurityError,
    is_local,
    load_keypair,
    load_public_key,
)
from pagedserve.core.memory import map_large_allocations
from pagedserve.core.models import (
    read_generation_eos,
    read_max_position_embeddings,
)
from pagedserve.core.readiness import mark_ready
from pagedserve.core.wire import HEALTH_LIVENESS, HEALTH_READINESS
from pagedserve.protos.v1 import generate_pb2_grpc
from pagedserve.scheduler.api import reflection
from pagedserve.scheduler.api.errors import ErrorInterceptor
from pagedserve.scheduler.api.frontend import Frontend
from pagedserve.scheduler.api.http_metrics import HTTPMetrics
from pagedserve.scheduler.api.http_server import HTTPServer, http_server
from pagedserve.scheduler.api.inputs import InputProcessor
from pagedserve.scheduler.api.openai_api import OpenAIApp
from pagedserve.scheduler.api.rpc_metrics import RpcMetrics
from pagedserve.scheduler.api.sampling_defaults import sampling_defaults
from pagedserve.scheduler.api.servicer import GenerationServicer
from pagedserve.scheduler.api.streams import OutputProcessor
from pagedserve.scheduler.api.tenants import Tenants, TenantsError
from pagedserve.scheduler.api.tls import CertificateFiles, TLSError
from pagedserve.scheduler.engine import Engine, _crash_on_error
from pagedserve.scheduler.engine_client import EngineClient
from pagedserve.scheduler.engine_host import local_only
from pagedserve.scheduler.engine_remote import RemoteEngineClient
from pagedserve.scheduler.engine_settings import (
    link_config,
    load_tokenizer,
    profiled,
    scheduler_config,
    setup_request_log,
)
from pagedserve.scheduler.executor_link import ExecutorLink, LinkBindError
from pagedserve.scheduler.metrics import Metrics
from pagedserve.scheduler.ports import BindError, cannot_listen, check_addresses
from pagedserve.scheduler.telemetry import Telemetry

log = logging.getLogger("pagedserve.scheduler")

# Health service names: "" is liveness (SERVING while the process runs), the API's own name is
# readiness (SERVING while a warmed-up executor is connected and the server is not draining).
LIVENESS, SERVICE = HEALTH_LIVENESS, HEALTH_READINESS
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health.aio.HealthServicer):
    """grpc's health service with List, which grpcio-health-checking's servicer leaves
    UNIMPLEMENTED (reflection lists it, so clients call it): every service's status, as
    Check would answer it."""

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()})  # what Check reads


async def serve(args: argparse.Namespace) -> None:
    link_cfg = link_config(args)  # before anything loads: a key problem fails at once
    check_addresses(args)  # and a busy port
    tenants = Tenants.from_file(args.api_keys) if args.api_keys else None
    tls = _tls(args)
    model_name = args.served_model_name or args.model
    metrics = Metrics(model_name, tenants=tuple(tenants.by_name) if tenants else ())
    if args.metrics_port:  # before the slow loading: a busy port fails at once
        try:
            reload_metrics_tls = metrics.serve(args.metrics_port, args.host, args.tls_cert,
                                               args.tls_key)
        except ValueError as e:
            raise TLSError(f"TLS certificate files for /metrics: {e}") from None
        except OSError as e:  # busy, or a host with no such address
            raise cannot_listen(f"--metrics-port {args.metrics_port}", args.host,
                                args.metrics_port, e) from None
        if tls is not None:
            tls.follow(reload_metrics_tls)
    model_dir, tokenizer = await load_tokenizer(args)
    model_len = await asyncio.to_thread(read_max_position_embeddings, model_dir)
    health_servicer = HealthServicer()
    loop = asyncio.get_running_loop()

    pending: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
    on_readiness = _readiness_setter(health_servicer, loop, pending)

    link = ExecutorLink(args.executor_bind, link_cfg)
    engine = Engine(scheduler_config(args), link, tokenizer,
                    read_generation_eos(model_dir), metrics=metrics,
                    telemetry=Telemetry(metrics, tokenizer, args.log_prompts),
                    on_readiness=on_readiness, async_scheduling=args.async_scheduling,
                    refuse_when_unready=args.refuse_when_unready)
    # the front ends, side by side on one engine client
    _, server, http = _front_ends(args, EngineClient(engine), tokenizer, model_dir, model_len,
                                  tenants,
                                  tls, metrics, health_servicer)
    if tenants is None:
        log.warning("no --api-keys: the API is open to anyone who reaches %s:%d", args.host,
                    args.port)
    await health_servicer.set(LIVENESS, SERVING)  # the process answers
    await health_servicer.set(SERVICE, NOT_SERVING)  # until an executor is connected
    address = f"{args.host}:{args.port}"
    bind(server, address, args.port, tls)
    if tls is not None:
        loop.add_signal_handler(signal.SIGHUP, tls.reload)
        pending.add(loop.create_task(tls.watch(), name="tls-watch"))  # until the process ends
    freeze_long_lived()  # the tokenizer, protobuf descriptors, ...
    await engine.start()
    await server.start()
    mark_ready()
    if http is not None:
        http_task = loop.create_task(http.serve(sockets=[http.socket]), name="http")
        http_task.add_done_callback(_crash_on_error)
        log.info("OpenAI-compatible HTTP API on %s:%d", args.host, args.http_port)
    log.info("gRPC listening on %s; waiting for an executor on %s", address, args.executor_bind)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if args.shutdown_delay_s > 0:  # not ready at once; new requests still served meanwhile
        engine.leave_soon()
        log.info("shutting down: not ready, serving %g s more before the drain",
                 args.shutdown_delay_s)
        await asyncio.sleep(args.shutdown_delay_s)
    await _drain(engine, args.drain_timeout_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5)  # the streams deliver their last chunk or error
    if http is not None:
        http.should_exit = True  # after the drain: its streams have ended too
        await http_task
    await engine.close()
    log.info("stopped")


async def serve_api(args: argparse.Namespace) -> None:
    """An API process (`pagedserve api`): gRPC and OpenAI HTTP on the engine core of
    --engine-address (engine_remote.py), sharing the ports with its sibling API processes.
    /metrics is the engine core's (with this process's counts added in)."""
    if not args.engine_address:
        raise BindError("--engine-address: give the engine core's ZeroMQ address")
    key, engine_public = None, b""
    if args.engine_key or args.engine_public_key:
        if not (args.engine_key and args.engine_public_key):
            raise LinkSecurityError("the engine socket's keys: give an API process both "
                                    "--engine-key (its own) and --engine-public-key (the "
                                    "engine core's)")
        key, engine_public = (load_keypair(args.engine_key),
                              load_public_key(args.engine_public_key))
    elif not is_local(args.engine_address):
        raise BindError(local_only(args.engine_address))
    tenants = Tenants.from_file(args.api_keys) if args.api_keys else None
    tls = _tls(args)
    model_name = args.served_model_name or args.model
    metrics = Metrics(model_name, tenants=tuple(tenants.by_name) if tenants else ())
    disable_created_metrics()  # as the engine core's /metrics serves them
    model_dir, tokenizer = await load_tokenizer(args)
    model_len = await asyncio.to_thread(read_max_position_embeddings, model_dir)
    health_servicer = HealthServicer()
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
    on_readiness = _readiness_setter(health_servicer, loop, pending)

    client = RemoteEngineClient(args.engine_address, metrics,
                                link_timeout_s=args.executor_link_timeout_s,
                                on_readiness=on_readiness, key=key,
                                engine_public_key=engine_public)
    outputs, server, http = _front_ends(args, client, tokenizer, model_dir, model_len, tenants,
                                        tls,
                                        metrics, health_servicer, reuse_port=True)
    await health_servicer.set(LIVENESS, SERVING)
    await health_servicer.set(SERVICE, NOT_SERVING)  # until the engine core says it serves
    address = f"{args.host}:{args.port}"
    bind(server, address, args.port, tls)
    if tls is not None:
        loop.add_signal_handler(signal.SIGHUP, tls.reload)
        pending.add(loop.create_task(tls.watch(), name="tls-watch"))
    freeze_long_lived()
    for t in await client.start():
        t.add_done_callback(_crash_on_error)
    await server.start()
    mark_ready()
    if http is not None:
        http_task = loop.create_task(http.serve(sockets=[http.socket]), name="http")
        http_task.add_done_callback(_crash_on_error)
    log.info("API process %s: gRPC on %s, HTTP on port %d, engine core at %s", client.api_id,
             address, args.http_port, args.engine_address)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if args.shutdown_delay_s > 0:
        client.leave_soon()
        await asyncio.sleep(args.shutdown_delay_s)
    client.draining = True
    client.leave_soon()  # (readiness: NOT_SERVING)
    deadline = time.monotonic() + args.drain_timeout_s
    while len(outputs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if left := outputs.fail_all("UNAVAILABLE", "the server shut down before the request "
                                "finished"):
        log.warning("drain timeout: aborted %d requests", left)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5)
    if http is not None:
        http.should_exit = True
        await http_task
    await client.close()
    log.info("stopped")


def _readiness_setter(health_servicer: HealthServicer, loop: asyncio.AbstractEventLoop,
                      pending: set[asyncio.Task]):
    """on_readiness for the engine (client): the readiness health status follows it."""

    def on_readiness(serving: bool) -> None:
        task = loop.create_task(health_servicer.set(SERVICE, SERVING if serving else NOT_SERVING))
        pending.add(task)
        task.add_done_callback(pending.discard)
        log.info("readiness: %s", "SERVING" if serving else "NOT_SERVING")

    return on_readiness


def _front_ends(args: argparse.Namespace, client, tokenizer, model_dir: Path, model_len: int,
                tenants: Tenants | None, tls: CertificateFiles | None, metrics: Metrics,
                health_servicer: HealthServicer, reuse_port: bool = False,
                ) -> tuple[OutputProcessor, grpc.aio.Server, HTTPServer | None]:
    """gRPC and OpenAI HTTP side by side on one engine client (in-process or remote), with
    health and reflection; nothing bound yet but the HTTP socket."""
    model_name = args.served_model_name or args.model
    outputs = OutputProcessor(client, tokenizer, args.stream_interval)
    frontend = Frontend(outputs, InputProcessor(tokenizer, args.max_input_bytes, model_len),
                        tenants, sampling_defaults(args.generation_config, model_dir))
    server = grpc_server(RpcMetrics(metrics.rpcs, model_name), reuse_port=reuse_port)
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(frontend, model_name),
                                                       server)
    api = HTTPMetrics(OpenAIApp(frontend, model_name, args.allow_runtime_lora_updating).app,
                      metrics.http_requests,
                      metrics.http_duration, model_name)
    http = http_server(api, args, tls, reuse_port) if args.http_port else None
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)  # open: probes
    if args.enable_reflection:
        reflection.enable(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
    return outputs, server, http


def grpc_server(*outer: grpc.aio.ServerInterceptor, reuse_port: bool = False,
                ) -> grpc.aio.Server:
    """The API server: `outer` interceptors see each call before the ErrorInterceptor does.
    so_reuseport off, except for the API processes of one engine core (which share the port:
    the kernel splits new connections between them): with it (gRPC's default on Linux) a
    second server on a busy port binds too."""
    return grpc.aio.server(interceptors=[*outer, ErrorInterceptor()],
                           options=[("grpc.so_reuseport", int(reuse_port))])


def bind(server: grpc.aio.Server, address: str, port: int, tls: CertificateFiles | None,
         ) -> None:
    """Bind the API port, or exit with one line naming --port (BindError)."""
    try:
        if tls is not None:
            bound = server.add_secure_port(address, tls.credentials())
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0 or (port and bound != port):
        raise BindError(f"--port {port}: cannot listen on {address} (is another server "
                        "running?)")


async def _drain(engine: Engine, timeout_s: float) -> None:
    """Graceful drain: refuse new requests, give the admitted ones timeout_s to finish."""
    log.info("draining: %d requests in flight, up to %g s", len(engine.streams), timeout_s)
    cut = await engine.drain(timeout_s)
    if cut:
        log.warning("drain timeout: aborted %d requests", cut)


def _tls(args: argparse.Namespace) -> CertificateFiles | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise TLSError("TLS needs both --tls-cert and --tls-key")
    try:
        return CertificateFiles(args.tls_cert, args.tls_key, args.tls_client_ca)
    except (OSError, ValueError) as e:
        raise TLSError(f"TLS certificate files: {e}") from e


def run_api(args: argparse.Namespace) -> None:
    """`pagedserve api`: one API process of an engine core in its own process."""
    setup_request_log()
    map_large_allocations()
    try:
        asyncio.run(serve_api(args))
    except (LinkSecurityError, TenantsError, TLSError, BindError) as e:
        raise SystemExit(f"pagedserve api: {e}") from None


def run(args: argparse.Namespace) -> None:
    setup_request_log()
    map_large_allocations()  # prompts of megabytes must not leave the heap fragmented
    try:
        with profiled(args.profile_dir, "scheduler"):
            asyncio.run(serve(args))
    except (LinkSecurityError, TenantsError, TLSError, BindError, LinkBindError) as e:
        raise SystemExit(f"pagedserve scheduler: {e}") from None
