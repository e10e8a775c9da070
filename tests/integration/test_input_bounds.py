"""Bounded work before validation, against running processes: the byte limit holds before an
executor joins, large prompts do not stall other streams, and the memory a burst of them takes
goes back to the OS."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2 as api
from tests.integration.service import Service, Stack

LIMIT = 2_000_000  # --max-input-bytes of big_service: prompts that take a while to tokenize
WORD = "The history of the printing press begins in the fifteenth century. "


def text_of(n: int) -> str:
    return (WORD * (n // len(WORD) + 1))[:n]


NEAR, OVER = text_of(LIMIT - 100), text_of(LIMIT + 100)


def big(tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("big") / "serve.log", "--max-input-bytes", str(LIMIT))
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0


@pytest.fixture(scope="module")
def big_service(tmp_path_factory, model_dir):
    yield from big(tmp_path_factory)


@pytest.fixture
def fresh_big_service(tmp_path_factory, model_dir):
    """A process no earlier burst has grown: what it held before is its own."""
    yield from big(tmp_path_factory)


def test_tokenize_before_an_executor_joins_is_bounded_by_the_models_length(tmp_path, tokenizer):
    stack = Stack(tmp_path, executor=False)
    try:
        stack.wait_health(health_pb2.HealthCheckResponse.SERVING, service="")  # liveness
        tokenize = stack.client.stub.Tokenize
        with pytest.raises(grpc.RpcError) as err:  # 32 bytes x the config's 8192 positions
            tokenize(api.TokenizeRequest(text="a" * 262_145), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "text: 262145 bytes, more than the 262144 a prompt may have"
        out = tokenize(api.TokenizeRequest(text="Hello there"), timeout=30)
        assert list(out.token_ids) == tokenizer.encode("Hello there")
    finally:
        stack.stop()


def send(svc, kind: str, text: str) -> str:
    """One large request; what it got: "ok", or its error's details."""
    try:
        if kind == "generate":
            list(svc.client.stub.Generate(build_request(text=text), timeout=120))
        else:
            svc.client.stub.Tokenize(api.TokenizeRequest(text=text), timeout=120)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        return e.details()
    return "ok"


OVER_LIMIT = f"text: {LIMIT + 100} bytes, more than the {LIMIT} a prompt may have"
WANT = {("generate", NEAR): "input: the prompt has", ("generate", OVER): OVER_LIMIT,
        ("tokenize", NEAR): "ok", ("tokenize", OVER): OVER_LIMIT}


def burst(svc, copies: int) -> None:
    """copies of each: a just-under-limit and an over-limit prompt, to Generate and Tokenize;
    all at once, each answered as it should be."""
    jobs = [key for key in WANT for _ in range(copies)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda key: send(svc, *key), jobs))
    assert all(g.startswith(WANT[k]) for g, k in zip(got, jobs, strict=True)), got


# Largest gap between a running 60-token stream's chunks while 2 MB prompts arrive. Measured on
# a loaded 2-core host with 12 such requests in flight: tokenizing on the event loop (as before)
# 0.93-1.88 s; on worker threads sharing every core 0.43 s; on the one thread that large inputs
# share 0.14-0.37 s. Time to the first chunk is left out: it queues behind the 2 MB requests
# the gRPC server is reading and took 1.29 s on CI's 2 cores, and it is not a stall.
MAX_GAP_S = 0.9


def test_large_prompts_do_not_stall_a_running_stream(big_service):
    svc, stop, answers = big_service, threading.Event(), []

    def keep_sending(kind: str, text: str) -> None:
        while not stop.is_set():
            answers.append((send(svc, kind, text), WANT[kind, text]))

    senders = [threading.Thread(target=keep_sending, args=key) for key in WANT
               for _ in range(3)]
    for t in senders:
        t.start()
    try:
        time.sleep(0.3)  # the large requests are being read and tokenized
        last, gaps, tokens = time.perf_counter(), [], 0
        for chunk in svc.client.stub.Generate(build_request(
                text="Count: 1, 2, 3,", max_tokens=60, ignore_eos=True, temperature=0),
                timeout=120):
            now = time.perf_counter()
            gaps.append(now - last)
            last, tokens = now, tokens + len(chunk.token_ids)
    finally:
        stop.set()
        for t in senders:
            t.join()
    assert tokens == 60
    assert len(answers) >= 12 and all(got.startswith(want) for got, want in answers)
    assert max(gaps[1:]) < MAX_GAP_S, sorted(gaps[1:])[-5:]


def test_memory_returns_after_a_burst_of_large_inputs(fresh_big_service):
    big_service = fresh_big_service

    def rss_mib() -> float:
        return big_service.metrics()["process_resident_memory_bytes"] / 2**20

    burst(big_service, 1)  # first use: the tokenizer's threads and caches
    time.sleep(2)
    before = rss_mib()
    for _ in range(2):
        burst(big_service, 3)
    deadline, after = time.monotonic() + 10, rss_mib()
    while after > 1.1 * before and time.monotonic() < deadline:
        time.sleep(0.5)
        after = rss_mib()
    assert after <= 1.1 * before, (before, after)
    assert big_service.client.complete(text="Hello", max_tokens=1)[1]


BODY_LIMIT = 2 * 262_144 + 2**20  # the default model: twice its input limit, plus 1 MiB
TOO_LARGE = {"type": "invalid_request_error", "param": None, "code": "request_too_large"}


def raw_http(svc, head: bytes, body_parts=()) -> tuple[int, dict]:
    """Send a request's head and body parts on a bare socket (the body need not be whole) and
    read the response: its status and JSON body."""
    with socket.create_connection(("127.0.0.1", svc.http_port), timeout=10) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        headers, rest = data.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length: (\d+)", headers).group(1))
        while len(rest) < length:
            rest += s.recv(65536)
    return int(headers.split()[1]), json.loads(rest)


def test_a_body_declared_too_large_is_refused_before_it_is_sent(service):
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000000000\r\n\r\n")  # and no body follows
    status, body = raw_http(service, head)
    assert status == 413
    assert body == {"error": {"message": f"request body: 1000000000 bytes, more than the "
                              f"{BODY_LIMIT} a request may have (twice the input limit, "
                              f"--max-input-bytes, plus 1 MiB)", **TOO_LARGE}}


def test_a_chunked_body_is_refused_once_past_the_limit(service):
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    part = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
    status, body = raw_http(service, head, [part] * (BODY_LIMIT // 65536 + 1))  # never ended
    assert status == 413
    assert body["error"] == {"message": f"request body: more than {BODY_LIMIT} bytes, more "
                             f"than the {BODY_LIMIT} a request may have (twice the input "
                             f"limit, --max-input-bytes, plus 1 MiB)", **TOO_LARGE}


def test_an_oversized_body_gets_413_from_the_sdk_and_the_server_serves_on(service):
    client = openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="default", prompt="a" * BODY_LIMIT, max_tokens=1)
    assert err.value.status_code == 413
    assert err.value.body["code"] == "request_too_large"
    assert err.value.body["message"].startswith("request body: ")
    out = client.completions.create(model="default", prompt="The capital of France is",
                                    max_tokens=2)
    assert out.usage.completion_tokens == 2
