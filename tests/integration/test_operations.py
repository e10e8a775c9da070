"""Operating the service: exact metrics, completion logs, readiness, executor loss, drain."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.client import build_request
from tests.integration.service import Service, Stack, health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TRAFFIC = [  # (request id, text, max_tokens, priority -> its metrics class)
    ("metrics-a", "The ocean is deep and", 3, 0),
    ("metrics-b", "Rules of chess: the knight moves", 5, 1),
    ("metrics-c", "A short list of prime numbers: 2, 3,", 7, 9),
]
CLASSES = {0: "0", 1: "1", 9: "2"}  # priority 9 is clamped to the "2" class


def _delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _run(client, rid: str, text: str, max_tokens: int, priority: int, out: dict) -> None:
    req = build_request(text=text, max_tokens=max_tokens, ignore_eos=True, temperature=0,
                        priority=priority)
    req.request_id = rid
    out[rid] = list(client.stub.Generate(req, timeout=120))


def test_metrics_move_by_exactly_the_traffic(service, tokenizer):
    before = _settled(service)
    outs: dict = {}
    threads = [threading.Thread(target=_run, args=(service.client, *t, outs)) for t in TRAFFIC]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = _settled(service)
    prompt = sum(len(tokenizer.encode(text)) for _, text, _, _ in TRAFFIC)
    gen = sum(n for _, _, n, _ in TRAFFIC)
    assert [c.usage.completion_tokens for rid, *_ in TRAFFIC for c in outs[rid][-1:]] == [3, 5, 7]

    def d(key: str) -> float:
        return _delta(before, after, f"pagedserve_{key}")

    assert d("prompt_tokens_total") == prompt
    assert d("generation_tokens_total") == gen
    assert d('request_success_total{finished_reason="length"}') == 3
    assert d('request_success_total{finished_reason="stop"}') == 0
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds",
                 "e2e_request_latency_seconds"):
        for cls in ("-2", "-1", "0", "1", "2"):
            expected = sum(1 for *_, p in TRAFFIC if CLASSES[p] == cls)
            assert d(f'{name}_count{{priority="{cls}"}}') == expected, (name, cls)
    assert d("request_prefill_time_seconds_count") == 3
    assert d("request_decode_time_seconds_count") == 3
    assert d("inter_token_latency_seconds_count") == gen - 3
    assert d("prefix_cache_queries_total") == prompt
    for mode in ("recompute", "swap"):
        assert d(f'num_preemptions_total{{mode="{mode}"}}') == 0
    # every step: the prompts not found cached, then one decode token per token but the last
    hits = d("prefix_cache_hits_total")
    assert d("iteration_tokens_total_sum") == prompt - hits + gen - 3
    steps = d("iteration_tokens_total_count")
    assert steps >= max(n for _, _, n, _ in TRAFFIC)
    assert d("executor_step_seconds_count") == d('executor_steps_total{mode="eager"}') == steps
    assert d('executor_steps_total{mode="cuda_graph"}') == 0
    assert 0 < after["pagedserve_device_memory_used_bytes"] \
        <= after["pagedserve_device_memory_total_bytes"]
    assert after["pagedserve_executor_connected"] == 1
    assert after["pagedserve_num_requests_running"] == after["pagedserve_num_requests_waiting"] == 0

    records = {r["request_id"]: r for r in _request_log(service.log_path.read_text())}
    for rid, text, n, priority in TRAFFIC:
        r = records[rid]
        assert (r["prompt_tokens"], r["completion_tokens"]) == (len(tokenizer.encode(text)), n)
        assert (r["finish_reason"], r["priority"], r["preemptions"]) == ("length", priority, 0)
        assert 0 <= r["queue_s"] <= r["ttft_s"] <= r["e2e_s"]
        assert "prompt" not in r  # no prompt text unless --log-prompts


def test_the_step_loops_time_is_split_by_phase_and_idleness_left_out(service):
    """Both processes' time per phase reaches /metrics: each phase of a request's steps is
    counted, the phases add up to no more than the request's wall time (nothing twice), and the
    executor's wait for work before the request is not counted as idle."""
    before = _settled(service)
    time.sleep(2.5)  # the executor waits for a plan meanwhile: no work, not the loop's pace
    t0 = time.monotonic()
    _run(service.client, "phases", "The ocean is deep and", 8, 0, {})
    wall = time.monotonic() - t0
    after = _settled(service)

    def d(family: str, label: str, value: str) -> float:
        return _delta(before, after, f'pagedserve_{family}_seconds_total{{{label}="{value}"}}')

    loop = {p: d("scheduler_loop", "phase", p) for p in
            ("plan", "send", "deliver", "update", "bitmask", "await_executor",
             "other_tasks")}
    host = {p: d("executor_host", "phase", p) for p in
            ("idle", "wait", "recv", "launch", "bitmask", "finish", "send")}
    assert all(loop[p] > 0 for p in ("plan", "send", "deliver", "update", "await_executor"))
    assert all(host[p] > 0 for p in ("recv", "launch", "finish", "send")), host
    assert host["bitmask"] == 0  # nothing constrained
    assert host["idle"] < 0.5, host  # not the 2.5 s before the request
    # nothing counted twice: a phase counted twice would add most of the wall time again; the
    # loop's last step (planned ahead, answered after the client has its last token) and the
    # API process's hop let the sums pass the client's wall time by a step, not more
    assert sum(loop.values()) < 1.1 * wall and sum(host.values()) < 1.1 * wall, \
        (wall, loop, host)
    assert d("executor_device", "state", "busy") == d("executor_device", "state", "gap") == 0
    assert _delta(before, after, "pagedserve_executor_cpu_seconds_total") > 0


def _settled(service: Service) -> dict[str, float]:
    """Metrics once idle and the last step is back. With async scheduling a step planned
    before a request's end of sequence is still in flight when the request has finished; its
    tokens are counted when its result comes (both step counters move then), so idle is not
    enough: wait until no step has come back for half a second (a step here takes tens of
    milliseconds)."""
    deadline = time.monotonic() + 10
    last = service.wait_idle()
    while True:
        time.sleep(0.5)
        m = service.wait_idle()
        key = "pagedserve_iteration_tokens_total_count"
        if m[key] == last[key] or time.monotonic() > deadline:
            return m
        last = m


def _request_log(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()
            if line.startswith('{"event": "request_finished"')]


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path, model_dir):
    svc = Service(tmp_path / "serve.log", "--drain-timeout-s", "60", "--log-prompts")
    try:
        svc.wait_serving()
        stream = svc.client.stub.Generate(
            build_request(text="Count: 1, 2, 3,", max_tokens=60, ignore_eos=True, temperature=0),
            timeout=120)
        chunks = [next(stream)]
        svc.proc.send_signal(signal.SIGTERM)
        while health(svc.client.channel) != NOT_SERVING:  # the scheduler got it
            time.sleep(0.02)
        assert health(svc.client.channel, "") == SERVING  # alive while it drains
        with pytest.raises(grpc.RpcError) as err:
            list(svc.client.stub.Generate(build_request(text="hi", max_tokens=2), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "server is draining"
        chunks += list(stream)
        assert sum(len(c.token_ids) for c in chunks) == 60
        assert chunks[-1].usage.completion_tokens == 60
        assert svc.proc.wait(timeout=60) == 0  # serve exits 0 only if every process did
    finally:
        svc.stop()
    log = (tmp_path / "serve.log").read_text()
    # serve's default split: the API processes (--api-server-count auto), engine core, executor
    assert re.search(r"api-0 exited with 0(, api-\d+ with 0)*, engine with 0, executor with 0",
                     log), log[-2000:]
    [record] = _request_log(log)
    assert record["prompt"] == "Count: 1, 2, 3,"  # --log-prompts


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    """One stack for the tests below, in order: the last one stops it. The link's ZeroMQ
    heartbeats are off (--executor-link-timeout-s 0): a SIGSTOPped executor then stands for a
    hung GPU, a live process whose step never returns, which only the step timeout catches
    (with them on, a stopped process is lost at once: test_faults)."""
    off = ("--executor-link-timeout-s", "0")
    s = Stack(tmp_path_factory.mktemp("stack"), "--executor-heartbeat-timeout-s", "2",
              "--executor-timeout-s", "3", "--drain-timeout-s", "1", *off, executor_flags=off)
    yield s
    s.stop()


def _cli_health(stack: Stack, *flags: str) -> int:
    cmd = [sys.executable, "-m", "pagedserve.cli", "health", "--address", stack.address, *flags]
    return subprocess.run(cmd, capture_output=True, timeout=60).returncode


def test_readiness_follows_the_executor(stack):
    stack.wait_health(SERVING)
    assert health(stack.client.channel, "") == SERVING
    assert (_cli_health(stack), _cli_health(stack, "--no-readiness")) == (0, 0)

    stack.executor.kill()  # dies while idle: its heartbeats stop
    stack.executor.wait()
    assert stack.wait_health(NOT_SERVING, timeout=10) < 5
    assert health(stack.client.channel, "") == SERVING  # liveness is the process
    assert (_cli_health(stack), _cli_health(stack, "--no-readiness")) == (1, 0)

    stack.executor = stack.start_executor()
    stack.wait_health(SERVING)
    assert stack.client.complete(text="Hello", max_tokens=2, temperature=0)[1]


def test_a_request_stuck_twice_fails_and_a_drain_timeout_aborts(stack):
    stack.wait_health(SERVING)
    stream = stack.client.stub.Generate(
        build_request(text="Count: 1, 2, 3,", max_tokens=400, ignore_eos=True), timeout=120)
    next(stream)
    for _ in range(2):  # a hung GPU, as the scheduler sees it; the second time fails it
        stack.executor.send_signal(signal.SIGSTOP)
        try:
            stack.wait_health(NOT_SERVING, timeout=30)
        finally:
            stack.executor.send_signal(signal.SIGCONT)
        stack.wait_health(SERVING)  # it woke up, beat again and was taken back, without state
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == ("the executor did not answer a step with this request "
                                   "within 3 s, twice")
    assert stack.client.complete(text="Hello", max_tokens=2, temperature=0)[1]

    stream = stack.client.stub.Generate(
        build_request(text="Count: 1, 2, 3,", max_tokens=400, ignore_eos=True), timeout=120)
    next(stream)
    stack.scheduler.send_signal(signal.SIGTERM)  # --drain-timeout-s 1
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down before the request finished" in err.value.details()
    assert stack.scheduler.wait(timeout=30) == 0
    stack.executor.send_signal(signal.SIGTERM)
    assert stack.executor.wait(timeout=30) == 0


def test_the_scheduler_profile_is_written_at_exit(tmp_path):
    """--profile-dir: after a served request and a SIGTERM, the scheduler leaves a pstats file
    and a readable table in which its step loop appears."""
    import pstats

    folder = tmp_path / "profile"
    stack = Stack(tmp_path, "--profile-dir", str(folder))
    try:
        stack.wait_health(health_pb2.HealthCheckResponse.SERVING, timeout=180)
        _, ids, _ = stack.client.complete(text="The capital of France is", max_tokens=4,
                                          temperature=0)
        assert len(ids) == 4
        stack.scheduler.send_signal(signal.SIGTERM)
        assert stack.scheduler.wait(timeout=60) == 0, stack.logs()
    finally:
        stack.stop()
    top = (folder / "scheduler_top.txt").read_text()
    assert "_step_loop" in top and "cumulative" in top
    stats = pstats.Stats(str(folder / "scheduler.prof")).stats
    assert any(fn == "_step_loop" for _, _, fn in stats)


def test_a_shutdown_delay_reports_not_ready_and_keeps_serving(tmp_path):
    """--shutdown-delay-s: on SIGTERM readiness (gRPC health, HTTP /health) turns NOT_SERVING
    at once, new requests are still answered for the delay, then the drain refuses them and
    the process exits 0 (a proxy has stopped sending by then)."""
    stack = Stack(tmp_path, "--shutdown-delay-s", "3", "--drain-timeout-s", "5")
    try:
        stack.wait_health(SERVING)
        sent = time.monotonic()
        stack.scheduler.send_signal(signal.SIGTERM)
        assert stack.wait_health(NOT_SERVING, timeout=5) < 1
        assert health(stack.client.channel, "") == SERVING  # alive
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/health/live") as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/health/ready")
        assert err.value.code == 503
        tokens = stack.client.complete(text="Hello", max_tokens=3, temperature=0,
                                       ignore_eos=True)[1]
        assert len(tokens) == 3 and time.monotonic() - sent < 3  # served within the delay
        assert stack.scheduler.wait(timeout=30) == 0
        assert time.monotonic() - sent >= 3
    finally:
        stack.stop()


def test_refuse_when_unready_sends_new_requests_elsewhere(tmp_path):
    """--refuse-when-unready: with its executor gone a replica answers new requests
    UNAVAILABLE at once (a proxy retries them on a peer) rather than queueing them."""
    stack = Stack(tmp_path, "--refuse-when-unready", "--executor-heartbeat-timeout-s", "2")
    try:
        stack.wait_health(SERVING)
        assert stack.client.complete(text="Hello", max_tokens=2, temperature=0)[1]
        stack.executor.kill()
        stack.executor.wait()
        stack.wait_health(NOT_SERVING, timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(stack.client.stub.Generate(build_request(text="hi", max_tokens=2), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "retry on another replica" in err.value.details()
        stack.executor = stack.start_executor()
        stack.wait_health(SERVING)
        assert stack.client.complete(text="Hello", max_tokens=2, temperature=0)[1]
    finally:
        stack.stop()
