"""The executor link against intruders: keys made by `pagedserve keys`, the scheduler bound on
every interface, and DEALER sockets playing a rogue executor."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from grpc_health.v1 import health_pb2

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from tests.integration.service import Stack, free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "What is the capital of France?"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    for where, name in ((d, "scheduler"), (d / "executors", "executor"),
                        (d / "executors", "second"), (d / "stranger", "stranger")):
        assert cli("keys", str(where), "--name", name).returncode == 0
    return d


@pytest.fixture(scope="module")
def stack(tmp_path_factory, keys, model_dir):
    s = Stack(tmp_path_factory.mktemp("keyed"), "--scheduler-key",
              str(keys / "scheduler.key_secret"), "--executor-allowed-keys",
              str(keys / "executors"), "--executor-heartbeat-timeout-s", "3",
              executor_flags=("--executor-key", str(keys / "executors/executor.key_secret"),
                              "--scheduler-public-key", str(keys / "scheduler.key")),
              link_host="0.0.0.0")
    s.wait_health(SERVING)
    yield s
    s.stop()


def rogue(address: str, secret_file: Path | None, server_key: Path | None) -> zmq.Socket:
    """A DEALER that says hello as an executor would (with CURVE keys if given)."""
    import zmq.auth

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret_file is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(secret_file)
        sock.curve_serverkey, _ = zmq.auth.load_certificate(server_key)
    sock.connect(address)
    hello = pb.Hello(capacity=pb.Capacity(num_kv_blocks=4096, block_size=16,
                                          max_model_len=8192, vocab_size=49152),
                     executor_id=f"rogue-{id(sock)}")
    for _ in range(3):
        sock.send(pb.ExecutorMessage(hello=hello).SerializeToString())
    return sock


def test_an_exposed_link_without_keys_refuses_to_start():
    out = cli("scheduler", "--executor-bind", f"tcp://0.0.0.0:{free_port()}", "--port",
              str(free_port()), "--metrics-port", "0")
    assert out.returncode != 0
    assert "reachable from other hosts" in out.stderr and "pagedserve keys" in out.stderr
    out = cli("executor", "--scheduler-address", "tcp://10.1.2.3:5557")
    assert out.returncode != 0 and "--insecure-executor-link" in out.stderr


def test_rogue_executors_get_nothing_and_the_real_one_keeps_serving(stack, keys, hf_greedy,
                                                                    tokenizer):
    address = f"tcp://127.0.0.1:{stack.zmq_port}"
    intruders = [rogue(address, None, None),  # no keys at all
                 rogue(address, keys / "stranger/stranger.key_secret",  # a key not allowed
                       keys / "scheduler.key")]
    _, ids, _ = stack.client.complete(chat=[("user", PROMPT)], temperature=0, max_tokens=24)
    assert ids == hf_greedy[4]
    time.sleep(1)
    for sock in intruders:
        assert not sock.poll(0), "an intruder received a message"
        sock.close()
    log = (stack.tmp / "scheduler.log").read_text()
    assert "rogue" not in log  # not even refused: the handshake stopped them


def test_heartbeats_run_inside_curve_and_drop_a_stopped_executor_mid_step(stack, hf_greedy):
    """With a step in flight only ZeroMQ's heartbeats can tell (the step timeout is 120 s):
    they flow through the CURVE session, so a stopped executor is lost within 3 s; after
    SIGCONT it says hello again and the stream is recomputed."""
    from pagedserve.client import build_request

    log = stack.tmp / "scheduler.log"
    seen = len(log.read_text())
    stream = stack.client.stub.Generate(build_request(chat=[("user", PROMPT)], temperature=0,
                                                      max_tokens=24), timeout=120)
    ids = list(next(stream).token_ids)
    stack.executor.send_signal(signal.SIGSTOP)
    try:
        assert stack.wait_health(NOT_SERVING, timeout=10) < 3
    finally:
        stack.executor.send_signal(signal.SIGCONT)
    ids += [t for chunk in stream for t in chunk.token_ids]
    assert ids == hf_greedy[4]
    assert "lost: its connection closed (the process died, or sent nothing, not even a " \
           "heartbeat, for 2 s)" in log.read_text()[seen:]


def test_a_second_executor_waits_until_the_first_is_gone(stack, keys):
    second = stack.start_executor("--executor-key", str(keys / "executors/second.key_secret"),
                                  "--scheduler-public-key", str(keys / "scheduler.key"))
    log = stack.tmp / f"executor{stack.executors}.log"
    deadline = time.monotonic() + 120
    while "refused this executor" not in log.read_text():
        assert time.monotonic() < deadline and second.poll() is None, log.read_text()
        time.sleep(0.2)
    assert "refused executor" in (stack.tmp / "scheduler.log").read_text()
    assert stack.client.complete(text="Hello", max_tokens=2, temperature=0)[1]  # the first
    stack.executor.kill()  # its connection closes: the second is adopted
    stack.executor.wait()
    stack.executor = second
    deadline = time.monotonic() + 30
    while "joined scheduler" not in log.read_text():
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    stack.wait_health(SERVING)
    assert "lost: its connection closed" in (stack.tmp / "scheduler.log").read_text()
    assert stack.client.complete(text="Hello", max_tokens=2, temperature=0)[1]
