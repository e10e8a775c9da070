"""The scheduler's listening addresses, checked before anything loads, so that a busy port ends
the process at once with one line naming its flag. Imports nothing heavy: `pagedserve serve`
may check them too before it starts its processes."""

from __future__ import annotations

import argparse
import errno
import socket


class BindError(Exception):
    """An address given on the command line cannot be bound; the message names the flag."""


def check_addresses(args: argparse.Namespace) -> None:
    """BindError if --port, --metrics-port, --http-port or --executor-bind cannot be bound now
    (the real binds come later, and check again)."""
    check_free(args.host, args.port, f"--port {args.port}")
    for flag in ("metrics_port", "http_port"):  # 0 or absent: not served
        if port := getattr(args, flag, 0):
            check_free(args.host, port, f"--{flag.replace('_', '-')} {port}")
    bind, flag = args.executor_bind, f"--executor-bind {args.executor_bind}"
    if bind.startswith("tcp://"):
        host, _, port = bind.removeprefix("tcp://").rpartition(":")
        check_free("0.0.0.0" if host == "*" else host.strip("[]"), int(port), flag)
    elif bind.startswith("ipc://"):
        check_ipc_free(bind.removeprefix("ipc://"), flag)


def check_ipc_free(path: str, flag: str) -> None:
    """BindError if a process listens on the Unix socket `path`. ZeroMQ's own bind would not
    say so: it replaces the file, and the other process's executor could no longer reach it."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            return  # no file, or one left by a process that is gone: ZeroMQ replaces it
    raise BindError(f"{flag}: cannot listen on {path}: another process listens there (is "
                    "another server running?)")


def check_free(host: str, port: int, flag: str) -> None:
    """BindError naming `flag` (e.g. "--port 50051") if host:port cannot be bound now."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except OSError as e:
        raise BindError(f"{flag}: cannot resolve {host!r}: {e.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            # as a server binds: a port whose old connections linger in TIME_WAIT is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise cannot_listen(flag, host, port, e) from None


def cannot_listen(flag: str, host: str, port: int, error: OSError) -> BindError:
    """The one-line error for a failed bind of host:port given by `flag` (the early check's
    and the real binds' alike)."""
    hint = " (is another server running?)" if error.errno == errno.EADDRINUSE else ""
    return BindError(f"{flag}: cannot listen on {host}:{port}: {error.strerror or error}{hint}")
