"""The chaos suite, in the compose layout (scheduler and executor as separate processes):
garbage on the executor address, an executor killed for real in prefill, in decode and while a
request is swapped out, an executor paused past the step timeout, the scheduler killed under
`serve`, cancel storms. After each fault (the `recovers` fixture): no KV block leaked, the
processes that lived through it are back within 10 % of their resident memory before it, and a
known greedy request gets HF's tokens."""

from __future__ import annotations

import json
import signal
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


@pytest.fixture(scope="module")
def tight_stack(tmp_path_factory, model_dir):
    """10 KV blocks, victims swapped to the executor's host memory, and a 4 s step timeout."""
    s = Stack(tmp_path_factory.mktemp("tight"), "--max-num-batched-tokens", "256",
              "--preemption-mode", "swap", "--executor-timeout-s", "4",
              executor_flags=("--num-kv-blocks", "10", "--swap-space-gib", "0.25"))
    s.wait_health(SERVING)
    yield s
    s.stop()


def resident(proc) -> int:
    import psutil

    return psutil.Process(proc.pid).memory_info().rss


@pytest.fixture
def recovers(request, hf_greedy):
    """Wraps a fault test on a Stack (named by the test's `stack`/`tight_stack` argument)."""
    s = request.getfixturevalue("stack" if "stack" in request.fixturenames else "tight_stack")
    _, ids, _ = s.client.complete(chat=CHAT, temperature=0, max_tokens=24)  # warm
    assert ids == hf_greedy[4]
    before = {proc.pid: resident(proc) for proc in (s.scheduler, s.executor)}
    yield s
    s.wait_health(SERVING)
    deadline = time.monotonic() + 30
    while (m := scrape(s.metrics_port))["pagedserve_num_requests_running"] + \
            m["pagedserve_num_requests_waiting"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
    assert m["pagedserve_num_requests_swapped"] == 0
    _, ids, _ = s.client.complete(chat=CHAT, temperature=0, max_tokens=24)
    assert ids == hf_greedy[4]
    for proc in (s.scheduler, s.executor):
        if proc.pid in before:  # a replaced executor starts afresh
            assert resident(proc) <= 1.1 * before[proc.pid], (proc.args[3], before)


def test_garbage_on_the_executor_address_is_dropped(stack, recovers, hf_greedy):
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
        stack, recovers, hf_greedy):
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


def test_an_executor_killed_in_a_long_prefill_loses_nothing(stack, recovers, model_dir,
                                                             tokenizer):
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


def test_a_cancel_storm_leaks_no_blocks(stack, recovers, hf_greedy):
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


def test_an_executor_killed_while_a_request_is_swapped_out_loses_nothing(
        tight_stack, recovers, hf_greedy, tokenizer):
    """The swapped request's KV lived only in the dead executor's host memory: it is
    recomputed from its prompt and every stream still equals HF's greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.conftest import MAX_TOKENS, PROMPTS, request_kwargs

    s = tight_stack

    def run(kind_content):
        return s.client.complete(**request_kwargs(*kind_content), temperature=0,
                                 max_tokens=MAX_TOKENS, timeout=180)[1]

    for _ in range(6):  # 8 prompts in 10 blocks: some round swaps a victim out
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(run, p) for p in PROMPTS]
            killed = False
            while not killed and not all(f.done() for f in futures):
                if scrape(s.metrics_port)["pagedserve_num_requests_swapped"] > 0:
                    s.executor.kill()
                    s.executor.wait()
                    s.executor = s.start_executor()
                    killed = True
                time.sleep(0.02)
            outputs = [f.result() for f in futures]
        assert outputs == hf_greedy
        if killed:
            return
    raise AssertionError("no request was swapped out in 6 rounds")


def test_an_executor_paused_past_the_step_timeout_is_dropped_then_rejoins(
        tight_stack, recovers, hf_greedy):
    """SIGSTOP keeps the TCP connection up, so only the 4 s step timeout can tell; after
    SIGCONT the old executor's late result is dropped and it joins again as a new one."""
    s = tight_stack
    stream = s.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                    timeout=180)
    ids = list(next(stream).token_ids)
    s.executor.send_signal(signal.SIGSTOP)
    try:
        assert s.wait_health(NOT_SERVING, timeout=30) < 10
    finally:
        s.executor.send_signal(signal.SIGCONT)
    for chunk in stream:  # re-queued, recomputed once the executor is back
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    assert s.executor.poll() is None  # the same process, adopted again


def _serve_until_it_stops(tmp_path, *flags: str, timeout: float = 120.0) -> tuple[int, str]:
    from tests.integration.service import Service

    svc = Service(tmp_path / "serve.log", *flags)
    try:
        code = svc.proc.wait(timeout=timeout)
    finally:
        svc.stop()
    return code, svc.log_path.read_text()


def test_serve_stops_at_once_when_the_kv_cache_cannot_fit(tmp_path, model_dir):
    """The executor's memory check fails for real (no KV block fits in the budget): one line
    that names the flag, exit code 78, and serve gives up without a restart."""
    start = time.monotonic()
    code, log = _serve_until_it_stops(tmp_path, "--kv-cache-gib", "0.0005")
    assert code == 1
    line = ("pagedserve executor: --kv-cache-gib 0.0005 holds no KV block of 737280 bytes; "
            "raise --kv-cache-gib")
    assert line in log.splitlines()
    assert f"executor cannot run with these settings; not restarting it: {line}" in log
    assert "restarting in" not in log and "Traceback" not in log
    assert time.monotonic() - start < 60


def test_serve_gives_up_on_an_executor_that_fails_twice_the_same_way_at_start(tmp_path,
                                                                             model_dir):
    code, log = _serve_until_it_stops(tmp_path, "--dtype", "float64")
    assert code == 1
    error = "ValueError: dtype must be one of ['bfloat16', 'float16', 'float32'] or auto, got " \
            "'float64'"
    assert log.count(error) == 3  # each start's traceback, then the supervisor's line
    assert log.count("executor exited with 1; restarting in") == 1
    assert ("executor failed twice the same way during start-up (exit code 1); not restarting "
            f"it: {error}") in log
