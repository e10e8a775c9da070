"""uvicorn serving the HTTP API on the scheduler's own asyncio loop, beside gRPC."""

from __future__ import annotations

import argparse
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn

from pagedserve.scheduler.api.tls import CertificateFiles
from pagedserve.scheduler.ports import cannot_listen


class HTTPServer(uvicorn.Server):
    """uvicorn's server minus its signal handlers: SIGTERM is the scheduler's, which drains the
    engine first and then sets should_exit."""

    socket: socket.socket

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: Any, args: argparse.Namespace, tls: CertificateFiles | None,
                reuse_port: bool = False) -> HTTPServer:
    """A server for app on --host:--http-port, its socket bound now (BindError names the flag),
    speaking TLS with the gRPC API's certificates, reloaded with them. reuse_port: the API
    processes of one engine core share the port (SO_REUSEPORT)."""
    extra: dict[str, Any] = {}
    if tls is not None:
        extra = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
        if args.tls_client_ca:
            extra |= {"ssl_ca_certs": args.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning",
                            access_log=False,
                            timeout_graceful_shutdown=5, **extra)
    config.load()
    if tls is not None:  # each handshake reads the context: new connections get new files
        tls.follow(lambda: config.ssl.load_cert_chain(args.tls_cert, args.tls_key))
    server = HTTPServer(config)
    server.socket = _bind(args.host, args.http_port, reuse_port)
    return server


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise cannot_listen(f"--http-port {port}", host, port, e) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
