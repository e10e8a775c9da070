"""The engine core as a process of its own (`pagedserve engine`, started by `pagedserve serve
--api-server-count N`): the executor link, the scheduler and the step loop, the engine socket
the API processes connect to (engine_host.py), and the one /metrics of the whole scheduler side
(the API processes' counts added in, metrics_merge.py). No public API port: those are the API
processes' (`pagedserve api`)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
from pathlib import Path

from pagedserve.core.collector import freeze_long_lived
from pagedserve.core.link_security import LinkSecurityError
from pagedserve.core.memory import map_large_allocations
from pagedserve.core.models import read_generation_eos
from pagedserve.core.readiness import mark_ready
from pagedserve.scheduler import metrics_http
from pagedserve.scheduler.engine import Engine, _crash_on_error
from pagedserve.scheduler.engine_host import EngineBindError, EngineHost
from pagedserve.scheduler.engine_settings import (
    link_config,
    load_tokenizer,
    profiled,
    scheduler_config,
    setup_request_log,
)
from pagedserve.scheduler.executor_link import ExecutorLink, LinkBindError
from pagedserve.scheduler.file_watch import watch_files
from pagedserve.scheduler.metrics import API_FAMILIES, Metrics
from pagedserve.scheduler.metrics_merge import MergedRegistry
from pagedserve.scheduler.ports import BindError, cannot_listen
from pagedserve.scheduler.telemetry import Telemetry

log = logging.getLogger("pagedserve.scheduler")


async def serve_engine(args: argparse.Namespace) -> None:
    if not args.engine_address:
        raise EngineBindError("--engine-address: give the ZeroMQ address the API processes "
                              "connect to (serve picks one itself)")
    link_cfg = link_config(args)
    model_name = args.served_model_name or args.model
    metrics = Metrics(model_name)
    model_dir, tokenizer = await load_tokenizer(args)
    host: EngineHost | None = None

    def on_readiness(serving: bool) -> None:
        log.info("engine readiness: %s", "SERVING" if serving else "NOT_SERVING")
        if host is not None:
            host.broadcast_state()

    link = ExecutorLink(args.executor_bind, link_cfg)
    engine = Engine(scheduler_config(args), link, tokenizer, read_generation_eos(model_dir),
                    metrics=metrics, telemetry=Telemetry(metrics, tokenizer, args.log_prompts),
                    on_readiness=on_readiness, async_scheduling=args.async_scheduling,
                    refuse_when_unready=args.refuse_when_unready)
    host = EngineHost(engine, args.engine_address, link_timeout_s=args.executor_link_timeout_s,
                      key_file=args.engine_key, allowed_keys_dir=args.engine_allowed_keys)
    loop = asyncio.get_running_loop()
    if args.metrics_port:
        from prometheus_client import disable_created_metrics

        disable_created_metrics()
        def api_texts() -> list[bytes]:  # on the metrics server's thread
            try:
                return asyncio.run_coroutine_threadsafe(host.pull_metrics(), loop).result(2.0)
            except Exception:  # noqa: BLE001 (a loop too busy to answer: the last texts)
                return host.metrics_texts()

        merged = MergedRegistry(metrics.registry, api_texts, API_FAMILIES)
        try:
            _, reload_tls = metrics_http.start(merged, args.metrics_port, args.host,
                                               args.tls_cert, args.tls_key)
        except ValueError as e:
            raise BindError(f"TLS certificate files for /metrics: {e}") from None
        except OSError as e:
            raise cannot_listen(f"--metrics-port {args.metrics_port}", args.host,
                                args.metrics_port, e) from None
    watch = None
    if args.metrics_port and args.tls_cert:  # rotated certificates, as the API ports take them
        reload = functools.partial(metrics_http.reload_certificates, reload_tls, args.tls_cert,
                                   args.tls_key)
        watch = loop.create_task(watch_files([Path(args.tls_cert), Path(args.tls_key)], reload),
                                 name="tls-watch")
        loop.add_signal_handler(signal.SIGHUP, reload)
    for t in await host.start():
        t.add_done_callback(_crash_on_error)
    freeze_long_lived()
    await engine.start()
    mark_ready()
    log.info("engine core on %s; waiting for an executor on %s", args.engine_address,
             args.executor_bind)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # the API processes drain first (serve stops them before this one); what is left ends here
    cut = await engine.drain(args.drain_timeout_s)
    if cut:
        log.warning("drain timeout: aborted %d requests", cut)
    await asyncio.sleep(0.1)  # the last outputs leave the socket
    if watch is not None:
        watch.cancel()
    await engine.close()
    await host.close()
    log.info("stopped")


def run(args: argparse.Namespace) -> None:
    setup_request_log()
    map_large_allocations()
    try:
        with profiled(args.profile_dir, "engine"):
            asyncio.run(serve_engine(args))
    except (LinkSecurityError, BindError, LinkBindError, EngineBindError) as e:
        raise SystemExit(f"pagedserve engine: {e}") from None
