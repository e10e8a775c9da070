"""The handled-RPC counter against a real grpc.aio server and client: every way a call ends is
counted once, under the code the client saw."""

import asyncio
import threading
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter

from pagedserve.scheduler.api.rpc_metrics import RpcMetrics

SERVICE = "test.v1.Svc"


async def _fast(request, context):
    # never awaits inside: a cancellation always finds it suspended at a yield
    while True:
        yield b"x"


async def _slow(request, context):
    while True:
        await asyncio.sleep(0.01)
        yield b"x"


async def _finite(request, context):
    for _ in range(3):
        yield b"x"


async def _rejects(request, context):
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
    yield b"x"  # pragma: no cover


@pytest.fixture(scope="module")
def server():
    handled = Counter("h", "h", ["model_name", "grpc_service", "grpc_method", "grpc_code"],
                      registry=CollectorRegistry())
    loop = asyncio.new_event_loop()
    started = threading.Event()
    port: list[int] = []

    async def main():
        srv = grpc.aio.server(interceptors=[RpcMetrics(handled, "m")])
        srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.unary_stream_rpc_method_handler(fn) for name, fn in
            (("Fast", _fast), ("Slow", _slow), ("Finite", _finite), ("Rejects", _rejects))})])
        port.append(srv.add_insecure_port("127.0.0.1:0"))
        await srv.start()
        started.set()
        await srv.wait_for_termination()

    threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True).start()
    started.wait(10)
    with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
        yield channel, handled


def _count(handled, method, code):
    return handled.labels("m", SERVICE, method, code)._value.get()


def _wait(handled, method, code, want):
    deadline = time.monotonic() + 10
    while _count(handled, method, code) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return _count(handled, method, code)


@pytest.mark.parametrize("method", ["Fast", "Slow"])
def test_a_client_cancel_counts_cancelled_wherever_the_handler_is_suspended(server, method):
    channel, handled = server
    for _ in range(20):
        call = channel.unary_stream(f"/{SERVICE}/{method}")(b"", timeout=30)
        next(call), next(call)
        call.cancel()
    assert _wait(handled, method, "CANCELLED", 20) == 20
    assert _count(handled, method, "UNKNOWN") == 0


@pytest.mark.parametrize("method", ["Fast", "Slow"])
def test_a_passed_deadline_counts_deadline_exceeded(server, method):
    channel, handled = server
    before = {code: _count(handled, method, code) for code in ("CANCELLED", "UNKNOWN")}
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as e:
            for _ in channel.unary_stream(f"/{SERVICE}/{method}")(b"", timeout=0.3):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait(handled, method, "DEADLINE_EXCEEDED", 3) == 3
    assert {code: _count(handled, method, code) for code in before} == before


def test_a_completed_stream_counts_ok_and_an_abort_its_code(server):
    channel, handled = server
    assert list(channel.unary_stream(f"/{SERVICE}/Finite")(b"", timeout=30)) == [b"x"] * 3
    with pytest.raises(grpc.RpcError) as e:
        list(channel.unary_stream(f"/{SERVICE}/Rejects")(b"", timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _wait(handled, "Finite", "OK", 1) == 1
    assert _wait(handled, "Rejects", "INVALID_ARGUMENT", 1) == 1
