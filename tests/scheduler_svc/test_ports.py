"""Busy ports end the scheduler with one line naming the flag, before or at the real bind."""

from __future__ import annotations

import argparse
import asyncio
import socket

import pytest
import zmq

from pagedserve.scheduler.api import server
from pagedserve.scheduler.api.http_server import http_server
from pagedserve.scheduler.executor_link import ExecutorLink, LinkBindError
from pagedserve.scheduler.ports import BindError, check_addresses, check_free


def test_check_free_names_the_flag_of_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(BindError) as err:
            check_free("127.0.0.1", port, f"--port {port}")
        assert str(err.value) == (f"--port {port}: cannot listen on 127.0.0.1:{port}: Address "
                                  "already in use (is another server running?)")
        with pytest.raises(BindError, match="^--port 1: cannot resolve 'no.such.host.invalid'"):
            check_free("no.such.host.invalid", 1, "--port 1")
    check_free("127.0.0.1", port, f"--port {port}")  # free again once closed


def test_an_ipc_executor_bind_in_use_is_refused(tmp_path):
    """ZeroMQ binds a second ROUTER to the same ipc:// path without complaint (taking the path
    from the first); the check refuses it, and accepts the file a dead process left."""
    path = tmp_path / "link"
    flag = f"--executor-bind ipc://{path}"
    args = argparse.Namespace(host="127.0.0.1", port=0, http_port=0, executor_bind=f"ipc://{path}")
    ctx = zmq.Context()
    first = ctx.socket(zmq.ROUTER)
    first.bind(f"ipc://{path}")
    try:
        with pytest.raises(BindError) as err:
            check_addresses(args)
        assert str(err.value) == (f"{flag}: cannot listen on {path}: another process listens "
                                  "there (is another server running?)")
    finally:
        first.close(linger=0)
        ctx.term()
    stale = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX) as gone:  # a socket file nobody listens on
        gone.bind(str(stale))
    assert stale.exists()
    check_addresses(argparse.Namespace(host="127.0.0.1", port=0, http_port=0,
                                       executor_bind=f"ipc://{stale}"))


def test_a_second_grpc_server_cannot_share_a_port():
    """gRPC turns SO_REUSEPORT on by default: two servers would both bind and split the
    connections between them. The bind after the early check must still refuse."""
    async def main() -> None:
        first = server.grpc_server()
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            with pytest.raises(BindError, match=f"^--port {port}: cannot listen on "
                                                f"127.0.0.1:{port} "):
                server.bind(server.grpc_server(), f"127.0.0.1:{port}", port, None)
        finally:
            await first.stop(None)

    asyncio.run(main())


def test_a_busy_executor_bind_names_its_flag():
    async def main() -> None:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            address = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
            link = ExecutorLink(address)
            with pytest.raises(LinkBindError, match=f"^--executor-bind {address}: cannot bind: "
                                                    "Address already in use"):
                await link.start()
            await link.close()

    asyncio.run(main())


def test_a_busy_http_port_names_its_flag_in_the_early_check_and_at_the_bind():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = argparse.Namespace(host="127.0.0.1", port=0, http_port=port, tls_cert="",
                                  executor_bind="tcp://127.0.0.1:0")
        message = (f"--http-port {port}: cannot listen on 127.0.0.1:{port}: Address already "
                   "in use (is another server running?)")
        with pytest.raises(BindError) as early:
            check_addresses(args)
        assert str(early.value) == message
        with pytest.raises(BindError) as late:
            http_server(None, args, None)
        assert str(late.value) == message
