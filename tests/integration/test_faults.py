"""The chaos suite, in both layouts: scheduler and executor as separate processes (Stack, as
compose runs them) and under `pagedserve serve` (Service). Garbage on the executor address, an
executor killed for real in prefill, in decode and while a request is swapped out, an executor
paused past the step timeout, a stale executor resumed after its successor joined, the
scheduler killed under `serve` with streams in flight, cancel storms. After each fault (the
`recovers` fixture): no KV block leaked, each process (or the one that replaced it) within
10 % of its resident memory before the fault, and a known greedy request gets HF's tokens.
Every test has a timeout (pytest-timeout); the file takes about 100 s on 2 cores."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import grpc
import psutil
import pytest
import zmq
from grpc_health.v1 import health_pb2

from pagedserve.client import build_request
from tests.integration.service import Service, Stack, health, scrape

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


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    """`pagedserve serve` with one scheduler process (the API processes' faults are
    test_api_processes.py's): the supervisor restarts whichever child a test kills."""
    svc = Service(tmp_path_factory.mktemp("serve") / "serve.log", "--api-server-count", "0")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0


def processes(s: Stack | Service) -> dict[str, psutil.Process]:
    """The live scheduler and executor processes, by role ("scheduler": the engine core
    where serve splits off API processes)."""
    if isinstance(s, Stack):
        return {"scheduler": psutil.Process(s.scheduler.pid),
                "executor": psutil.Process(s.executor.pid)}
    children = psutil.Process(s.proc.pid).children()
    return {role: next(p for p in children if any(c in p.cmdline() for c in commands))
            for role, commands in (("scheduler", ("scheduler", "engine")),
                                   ("executor", ("executor",)))}


def wait_serving(s: Stack | Service, timeout: float = 120.0) -> None:
    if isinstance(s, Stack):
        s.wait_health(SERVING, timeout=timeout)
    else:
        s.wait_serving(timeout)


def seconds_until(s: Stack | Service, status: int, since: float, timeout: float = 10.0) -> float:
    """Seconds from `since` (monotonic) until readiness reports status."""
    while health(s.client.channel) != status:
        assert time.monotonic() - since < timeout, f"readiness never became {status}"
        time.sleep(0.05)
    return time.monotonic() - since


class Baseline:
    """Resident memory of each process by role, taken before the fault."""

    def __init__(self, s: Stack | Service) -> None:
        self.s = s
        self.take()

    def take(self) -> None:
        """Again, after a test's own warm-up: the CPU KV cache is allocated untouched, so a
        request longer than any before it raises resident memory by its KV pages (46 KB a
        token here), which is no leak."""
        self.rss = {role: p.memory_info().rss for role, p in processes(self.s).items()}


@pytest.fixture
def recovers(request, hf_greedy):
    """Wraps a fault test on a Stack or Service (the test's `stack`, `tight_stack` or `served`
    argument). A process replaced during the fault is held to its predecessor's resident
    memory: same model, same KV cache, same flags."""
    name = next(n for n in ("stack", "tight_stack", "served") if n in request.fixturenames)
    s = request.getfixturevalue(name)
    _, ids, _ = s.client.complete(chat=CHAT, temperature=0, max_tokens=24)  # warm
    assert ids == hf_greedy[4]
    baseline = Baseline(s)
    yield baseline
    before = baseline.rss
    wait_serving(s)
    deadline = time.monotonic() + 30
    while (m := scrape(s.metrics_port))["pagedserve_num_requests_running"] + \
            m["pagedserve_num_requests_waiting"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
    assert m["pagedserve_num_requests_swapped"] == 0
    _, ids, _ = s.client.complete(chat=CHAT, temperature=0, max_tokens=24)
    assert ids == hf_greedy[4]
    after = {role: p.memory_info().rss for role, p in processes(s).items()}
    for role, rss in after.items():
        assert rss <= 1.1 * before[role], (role, before, after)


def finished_record(path: Path, seen: int, request_id: str, timeout: float = 10.0) -> dict:
    """The request_finished record of request_id in the log at path past offset `seen`, once
    it is there: it is written after the stream's last message (by its API process, through
    serve's log under serve), so a client can read the end of a stream before the record."""
    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(line) for line in path.read_text()[seen:].splitlines()
                   if line.startswith('{"event": "request_finished"')
                   and f'"request_id": "{request_id}"' in line]
        if records:
            [record] = records
            return record
        assert time.monotonic() < deadline, f"no record of {request_id} in {timeout}s"
        time.sleep(0.05)


def logged_time(asctime: str) -> float:
    """A log line's time (logging's asctime, local time) as time.time() would give it."""
    from datetime import datetime

    return datetime.strptime(asctime, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def executor_id(log: Path) -> str:
    """The id an executor says hello with, from its log."""
    deadline = time.monotonic() + 60
    while not (m := re.search(r"executor (\w+) connecting to", log.read_text())):
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    return m.group(1)


@pytest.mark.timeout(60)
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


@pytest.mark.timeout(90)
def test_an_executor_killed_mid_stream_is_noticed_at_once_and_its_requests_recomputed(
        stack, recovers, hf_greedy):
    stream = stack.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                        timeout=180)
    ids = list(next(stream).token_ids)
    stack.executor.kill()
    stack.executor.wait()
    assert stack.wait_health(NOT_SERVING, timeout=10) < 3  # not the 120 s step timeout
    late = stack.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                      timeout=180)
    # the gauges follow the outage: the re-queued request and the one sent meanwhile wait
    deadline = time.monotonic() + 5
    while (m := scrape(stack.metrics_port))["pagedserve_num_requests_waiting"] != 2:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["pagedserve_num_requests_running"] == 0
    stack.executor = stack.start_executor()
    for chunk in stream:  # the request waited, then was recomputed on the new executor
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    assert [t for chunk in late for t in chunk.token_ids] == hf_greedy[4]
    assert stack.wait_health(SERVING) < 1


@pytest.mark.timeout(90)
def test_under_serve_a_killed_executor_is_noticed_at_once_and_no_request_is_lost(
        served, recovers, hf_greedy):
    """Readiness turns NOT_SERVING within 3 s of `kill -9`; the running stream is recomputed on
    the executor serve restarts, and a request sent during the outage waits for it (README:
    Executor loss) rather than failing."""
    seen = len(served.log_path.read_text())
    stream = served.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                         timeout=120)
    ids = list(next(stream).token_ids)
    processes(served)["executor"].kill()
    killed = time.monotonic()
    assert seconds_until(served, NOT_SERVING, killed) < 3
    late = served.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24,
                                                     request_id="sent-during-the-outage"),
                                       timeout=120)
    for chunk in stream:
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    assert [t for chunk in late for t in chunk.token_ids] == hf_greedy[4]
    record = finished_record(served.log_path, seen, "sent-during-the-outage")
    log = served.log_path.read_text()[seen:]
    assert "executor exited with -9; restarting" in log
    back = re.search(r"^(\S+ \S+) INFO pagedserve.scheduler: readiness: SERVING$", log, re.M)
    assert record["ts"] - record["e2e_s"] < logged_time(back.group(1))  # it arrived, and waited


@pytest.mark.timeout(60)
def test_under_serve_a_paused_executor_is_lost_within_3s_and_adopted_again(served, recovers,
                                                                            hf_greedy):
    """serve sees no exit (the process is stopped, not dead): only the link's heartbeats can
    tell. After SIGCONT the same process says hello again and the stream is recomputed."""
    seen = len(served.log_path.read_text())
    stream = served.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                         timeout=120)
    ids = list(next(stream).token_ids)
    executor = processes(served)["executor"]
    executor.suspend()
    try:
        assert seconds_until(served, NOT_SERVING, time.monotonic()) < 3
    finally:
        executor.resume()
    for chunk in stream:
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    log = served.log_path.read_text()[seen:]
    assert "lost: its connection closed" in log and "restarting" not in log
    assert processes(served)["executor"].pid == executor.pid


@pytest.mark.timeout(90)
def test_serve_restarts_a_scheduler_killed_for_real_and_its_streams_end_unavailable(
        served, recovers, hf_greedy):
    """Streams cut by the scheduler's death end UNAVAILABLE (README: Errors); the new
    scheduler adopts the executor that lived on and serves exactly."""
    streams = [served.client.stub.Generate(build_request(text=f"Story {i}:", max_tokens=200,
                                                         ignore_eos=True), timeout=60)
               for i in range(4)]
    for s in streams:
        next(s)  # running
    processes(served)["scheduler"].kill()
    for s in streams:
        with pytest.raises(grpc.RpcError) as cut:
            for _ in s:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    served.wait_serving(60)  # a new scheduler; the executor rejoins
    assert "scheduler exited with -9; restarting" in served.log_path.read_text()


def long_prompt_case(tokenizer, model_dir, word: str) -> tuple[list[int], list[int]]:
    """~1,550 prompt tokens (four prefill chunks of at most 512, of about a second each here) and
    HF's 6 greedy tokens after them."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode(" ".join(f"{word}{i}" for i in range(400)))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id or 2)[0, len(ids):].tolist()
    return ids, want


@pytest.mark.timeout(120)
def test_an_executor_killed_in_a_long_prefill_loses_nothing(stack, recovers, model_dir,
                                                             tokenizer):
    ids, want = long_prompt_case(tokenizer, model_dir, "item")
    other = tokenizer.encode(" ".join(f"thing{i}" for i in range(400)))  # no shared prefix
    stack.client.complete(token_ids=other, temperature=0, max_tokens=1, timeout=60)
    recovers.take()  # the executor's KV pages for such a prompt are resident now
    m0 = scrape(stack.metrics_port)
    stream = stack.client.stub.Generate(build_request(token_ids=ids, temperature=0, max_tokens=6,
                                                      request_id="killed-in-prefill"),
                                        timeout=180)
    deadline = time.monotonic() + 60
    while (m := scrape(stack.metrics_port))["pagedserve_iteration_tokens_total_sum"] < \
            m0["pagedserve_iteration_tokens_total_sum"] + 256:  # its first chunk is done
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert m["pagedserve_generation_tokens_total"] == m0["pagedserve_generation_tokens_total"]
    stack.executor.kill()
    killed_at = time.time()
    stack.executor.wait()
    stack.executor = stack.start_executor()
    got = [t for chunk in stream for t in chunk.token_ids]
    assert got == want
    record = finished_record(stack.tmp / "scheduler.log", 0, "killed-in-prefill")
    assert record["preemptions"] == 1  # recomputed on the new executor, from its prompt
    arrival = record["ts"] - record["e2e_s"]
    assert arrival + record["ttft_s"] > killed_at  # no token before the kill: it was prefilling


@pytest.mark.timeout(60)
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


@pytest.mark.timeout(120)
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


@pytest.mark.timeout(60)
def test_an_executor_paused_past_the_step_timeout_is_lost_within_seconds_then_readopted(
        tight_stack, recovers, hf_greedy):
    """SIGSTOP keeps the TCP connection up, but the stopped process answers no ZeroMQ
    heartbeat: lost within 3 s, not at the 4 s step timeout. Held past that, then SIGCONT:
    its late result is dropped and the same process is adopted again through a new hello."""
    s = tight_stack
    log_path = s.tmp / "scheduler.log"
    me = executor_id(s.tmp / f"executor{s.executors}.log")
    seen = len(log_path.read_text())
    stream = s.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                    timeout=180)
    ids = list(next(stream).token_ids)
    s.executor.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert seconds_until(s, NOT_SERVING, stopped) < 3
        time.sleep(max(0.0, 4.5 - (time.monotonic() - stopped)))  # past the step timeout
    finally:
        s.executor.send_signal(signal.SIGCONT)
    for chunk in stream:  # re-queued, recomputed once the executor is back
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    log = log_path.read_text()[seen:]
    assert f"executor {me} lost: its connection closed (the process died, or sent nothing, " \
           "not even a heartbeat, for 2 s)" in log
    assert "took longer than" not in log
    assert re.search(r"dropped the result of step \d+ from a peer that is not the adopted "
                     r"executor", log), log
    assert log.count(f"executor {me} joined") == 1  # the same process, adopted again


@pytest.mark.timeout(90)
def test_a_stale_executor_resumed_after_its_successor_joined_is_refused_and_ignored(
        stack, recovers, hf_greedy):
    """Executor A stopped mid-stream is lost; B is started and adopted; A resumes with the
    steps it had in hand: it is refused, its results are dropped, outputs stay exact."""
    log_path = stack.tmp / "scheduler.log"
    seen = len(log_path.read_text())
    a = stack.executor
    a_id = executor_id(stack.tmp / f"executor{stack.executors}.log")
    stream = stack.client.stub.Generate(build_request(chat=CHAT, temperature=0, max_tokens=24),
                                        timeout=120)
    ids = list(next(stream).token_ids)
    a.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        assert seconds_until(stack, NOT_SERVING, stopped) < 3
        stack.executor = stack.start_executor()
        b_id = executor_id(stack.tmp / f"executor{stack.executors}.log")
        stack.wait_health(SERVING, timeout=60)
        a.send_signal(signal.SIGCONT)  # B recomputes the stream now
        deadline = time.monotonic() + 10
        while f"refused executor {a_id}" not in log_path.read_text()[seen:]:
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.1)
        for chunk in stream:
            ids.extend(chunk.token_ids)
        assert ids == hf_greedy[4]
        log = log_path.read_text()[seen:]
        assert re.search(r"dropped the result of step \d+ from a peer that is not the "
                         r"adopted executor", log), log
        assert f"executor {b_id} joined" in log and f"executor {a_id} joined" not in log
    finally:
        a.send_signal(signal.SIGCONT)
        a.kill()
        a.wait()


def _serve_until_it_stops(tmp_path, *flags: str, timeout: float = 120.0) -> tuple[int, str]:
    from tests.integration.service import Service

    svc = Service(tmp_path / "serve.log", *flags)
    try:
        code = svc.proc.wait(timeout=timeout)
    finally:
        svc.stop()
    return code, svc.log_path.read_text()


@pytest.mark.timeout(90)
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


@pytest.mark.timeout(90)
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
