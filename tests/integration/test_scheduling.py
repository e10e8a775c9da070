"""Scheduling policy through the real service: deadlines, queue bounds, priorities."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pagedserve.client import build_request

LONG = dict(text="Count: 1, 2, 3,", temperature=0, ignore_eos=True)


def test_deadline_aborts_the_request_and_frees_its_blocks(service):
    with pytest.raises(grpc.RpcError) as err:
        service.client.complete(**LONG, max_tokens=2000, timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    m = service.wait_idle(timeout=5)
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]


def test_full_queue_refuses_with_a_retry_hint(queue_service):
    svc = queue_service
    refused = 'pagedserve_num_requests_refused_total{reason="queue_full"}'
    before = svc.metrics().get(refused, 0)  # the session's service: other tests refuse too
    running = svc.client.stub.Generate(build_request(**LONG, max_tokens=400), timeout=120)
    next(running)  # it holds the only sequence slot
    waiting = svc.client.stub.Generate(build_request(**LONG, max_tokens=4), timeout=120)
    deadline = time.monotonic() + 10
    while svc.metrics()["pagedserve_num_requests_waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as err:
        svc.client.complete(**LONG, max_tokens=4, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting_requests" in err.value.details()
    trailers = dict(err.value.trailing_metadata())
    assert int(trailers["retry-after-ms"]) >= 1000
    assert svc.metrics()[refused] == before + 1
    running.cancel()
    # the queued one is served once the slot frees (its 4 tokens, in however many messages)
    assert sum(len(c.token_ids) for c in waiting) == 4
    svc.wait_idle()


def test_high_priority_request_preempts_and_low_priority_output_is_unchanged(queue_service):
    svc = queue_service
    _, alone, _ = svc.client.complete(**LONG, max_tokens=60, priority=5)
    low_result = {}

    def low():
        low_result["ids"] = svc.client.complete(**LONG, max_tokens=60, priority=5)[1]

    t = threading.Thread(target=low)
    t.start()
    deadline = time.monotonic() + 30
    while svc.metrics()["pagedserve_generation_tokens_total"] < 60 + 5:  # low is decoding
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = svc.metrics()["pagedserve_num_priority_preemptions_total"]
    start = time.monotonic()
    _, vip, last = svc.client.complete(text="The capital of France is", max_tokens=3,
                                       temperature=0, priority=0)
    vip_latency = time.monotonic() - start
    low_running = t.is_alive()
    t.join(timeout=120)
    assert len(vip) == 3 and low_running  # served while the low-priority one was unfinished
    assert svc.metrics()["pagedserve_num_priority_preemptions_total"] == before + 1
    assert low_result["ids"] == alone  # preempted, recomputed, same tokens
    assert vip_latency < 10
