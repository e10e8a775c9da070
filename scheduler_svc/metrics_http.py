"""The metrics port: GET /metrics (text or OpenMetrics, as the scraper's Accept header asks),
404 for every other path, over HTTP or HTTPS.

prometheus_client's own server answers every path with the metrics text, so a probe of
`/health` or `/` on this port would read as healthy; this one says what it does not serve."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

METRICS_PATH = "/metrics"
log = logging.getLogger("pagedserve.scheduler")


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Scrapes every few seconds would flood stderr."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scraper must not keep the process alive


def metrics_app(registry: CollectorRegistry) -> Callable:
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == METRICS_PATH:
            return metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found: this port serves {METRICS_PATH} only\n".encode()]

    return app


def start(registry: CollectorRegistry, port: int, host: str = "0.0.0.0", certfile: str = "",
          keyfile: str = "") -> tuple[WSGIServer, Callable[[], None]]:
    """Serve in a daemon thread. Returns the server and what re-reads certfile and keyfile for
    new connections (a no-op over HTTP). OSError: the port cannot be bound (e.g. it is busy);
    ValueError: the certificate files cannot be used."""
    reload: Callable[[], None] = lambda: None  # noqa: E731
    context = None
    if certfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(certfile, keyfile)
        except OSError as e:  # ssl.SSLError too
            raise ValueError(f"{certfile}, {keyfile}: {e}") from e
        # each handshake reads the listening socket's context: reloading it is enough
        reload = lambda: context.load_cert_chain(certfile, keyfile)  # noqa: E731
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    httpd = make_server(host, port, metrics_app(registry), server_class, handler_class=_Quiet)
    if context is not None:
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd, reload


def reload_certificates(reload: Callable[[], None], certfile: str, keyfile: str) -> None:
    """reload() (start's), logged: the engine core's /metrics follows rotated certificates
    as the API processes' ports do; a pair that cannot be loaded (half written) keeps the
    previous one until the next change."""
    try:
        reload()
        log.info("/metrics TLS certificates reloaded from %s, %s", certfile, keyfile)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        log.error("/metrics TLS certificate reload failed, keeping the previous one: %s", e)
