"""Faults in the compose layout (scheduler and executor as separate processes, default
timeouts): garbage on the executor address, an executor killed for real mid-stream."""

from __future__ import annotations

import time

import pytest
import zmq
from grpc_health.v1 import health_pb2

from pagedserve.client import build_request
from tests.integration.service import Stack, health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CHAT = [("user", "What is the capital of France?")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    s = Stack(tmp_path_factory.mktemp("faults"))
    s.wait_health(SERVING)
    yield s
    s.stop()


def test_garbage_on_the_executor_address_is_dropped(stack, hf_greedy):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.bind)
    sock.send(b"\x0a\xff\xff\xff\xff\x0f garbage")
    sock.send_multipart([b"two", b"frames"])
    time.sleep(0.5)
    sock.close()
    assert stack.scheduler.poll() is None and health(stack.client.channel) == SERVING
    _, ids, _ = stack.client.complete(chat=CHAT, temperature=0, max_tokens=24)
    assert ids == hf_greedy[4]
    assert "dropped a malformed frame from a peer" in (stack.tmp / "scheduler.log").read_text()


def test_an_executor_killed_mid_stream_is_noticed_at_once_and_its_requests_recomputed(
        stack, hf_greedy):
    stream = stack.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                        timeout=180)
    ids = list(next(stream).token_ids)
    stack.executor.kill()
    stack.executor.wait()
    assert stack.wait_health(NOT_SERVING, timeout=10) < 3  # not the 120 s step timeout
    stack.executor = stack.start_executor()
    for chunk in stream:  # the request waited, then was recomputed on the new executor
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    assert stack.wait_health(SERVING) < 1


def test_serve_restarts_a_scheduler_killed_for_real(tmp_path, model_dir, hf_greedy):
    import psutil

    from tests.integration.service import Service

    svc = Service(tmp_path / "serve.log")
    try:
        svc.wait_serving()
        serve = psutil.Process(svc.proc.pid)
        [scheduler] = [p for p in serve.children() if "scheduler" in p.cmdline()]
        scheduler.kill()
        deadline = time.monotonic() + 120
        while health(svc.client.channel) != SERVING:  # a new scheduler; the executor rejoins
            assert svc.proc.poll() is None and time.monotonic() < deadline, \
                svc.log_path.read_text()[-3000:]
            time.sleep(0.5)
        _, ids, _ = svc.client.complete(chat=CHAT, temperature=0, max_tokens=24)
        assert ids == hf_greedy[4]
        assert "scheduler exited with -9; restarting" in svc.log_path.read_text()
    finally:
        assert svc.stop() == 0
