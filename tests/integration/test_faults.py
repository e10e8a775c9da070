"""Faults in the compose layout (scheduler and executor as separate processes, default
timeouts): garbage on the executor address, an executor killed for real mid-stream."""

from __future__ import annotations

import json
import time

import pytest
import zmq
from grpc_health.v1 import health_pb2

from pagedserve.client import build_request
from tests.integration.service import Stack, health, scrape

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


def test_an_executor_killed_in_a_long_prefill_loses_nothing(stack, model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = " ".join(f"item{i}" for i in range(900))  # ~3,500 tokens: a prefill of seconds
    ids = tokenizer.encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id or 2)[0, len(ids):].tolist()
    stream = stack.client.stub.Generate(build_request(token_ids=ids, temperature=0,
                                                      max_tokens=6), timeout=180)
    time.sleep(0.5)  # in its prefill now
    stack.executor.kill()
    stack.executor.wait()
    stack.executor = stack.start_executor()
    got = [t for chunk in stream for t in chunk.token_ids]
    assert got == want
    log = (stack.tmp / "scheduler.log").read_text()
    [record] = [json.loads(line) for line in log.splitlines()
                if line.startswith('{"event": "request_finished"')
                and f'"prompt_tokens": {len(ids)},' in line]
    assert record["preemptions"] == 1  # recomputed on the new executor, from its prompt


def test_a_cancel_storm_leaks_no_blocks(stack, hf_greedy):
    streams = [stack.client.stub.Generate(build_request(text=f"Story {i}:", max_tokens=200,
                                                        ignore_eos=True), timeout=60)
               for i in range(40)]
    for i, s in enumerate(streams):
        if i % 2:
            next(s)  # some after their first token, some before
        s.cancel()
    deadline = time.monotonic() + 30
    while True:
        m = scrape(stack.metrics_port)
        if m["pagedserve_num_requests_running"] == m["pagedserve_num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
    _, ids, _ = stack.client.complete(chat=CHAT, temperature=0, max_tokens=24)
    assert ids == hf_greedy[4]
