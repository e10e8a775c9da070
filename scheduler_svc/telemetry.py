"""Per-request timings, metrics and the completion log line, kept off the engine's logic.

A request's life, as measured here (monotonic clock):
    arrival --queue--> first scheduled --prefill--> first token --decode--> last token
    |<----------------- TTFT ------------------------------>|
    |<----------------- end to end ------------------------------------------------->|
A preempted request keeps its first scheduled time: queue time counts the first wait only.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.metrics import Metrics, observe_many

if TYPE_CHECKING:
    from pagedserve.scheduler.engine import RequestStream

request_log = logging.getLogger("pagedserve.requests")
_MODES = {pb.EXECUTION_MODE_CUDA_GRAPH: "cuda_graph"}  # anything else counts as eager


class Telemetry:
    def __init__(self, metrics: Metrics, tokenizer: Any = None, log_prompts: bool = False) -> None:
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.log_prompts = log_prompts
        self._itl: list[float] = []  # inter-token latencies of this delivery, see flush()

    def scheduled(self, stream: RequestStream, now: float) -> None:
        if not stream.scheduled_at:
            stream.scheduled_at = now
            self.metrics.queue_time[stream.priority_class].observe(now - stream.arrival)

    def token(self, stream: RequestStream, now: float) -> None:
        m = self.metrics
        if stream.first_token_at:
            self._itl.append(now - stream.last_token_at)
        else:
            stream.first_token_at = now
            m.ttft[stream.priority_class].observe(now - stream.arrival)
            m.prefill_time.observe(now - (stream.scheduled_at or stream.arrival))
        stream.last_token_at = now

    def flush(self) -> None:
        """Record the inter-token latencies gathered by token() since the last flush."""
        if self._itl:
            observe_many(self.metrics.itl, self._itl)
            self._itl = []

    def finished(self, stream: RequestStream, reason: str, now: float) -> None:
        """reason: "stop" or "length" (counted as successes), else "abort" or a status code."""
        m = self.metrics
        if reason in m.success:
            m.success[reason].inc()
            m.e2e[stream.priority_class].observe(now - stream.arrival)
            m.decode_time.observe(now - stream.first_token_at)
        if request_log.isEnabledFor(logging.INFO):
            request_log.info(json.dumps(self._record(stream, reason, now)))

    def step(self, result: pb.StepResult, num_batched: int, num_sampled: int) -> None:
        """A step came back: num_batched tokens ran, num_sampled tokens went to requests."""
        m = self.metrics
        m.step_tokens.observe(num_batched)
        m.generation_tokens.inc(num_sampled)
        m.step_time.observe(result.execute_seconds)
        m.steps[_MODES.get(result.execution_mode, "eager")].inc()
        if result.device_memory_total_bytes:
            m.device_memory_used.set(result.device_memory_used_bytes)
            m.device_memory_total.set(result.device_memory_total_bytes)

    def _record(self, stream: RequestStream, reason: str, now: float) -> dict[str, Any]:
        req = stream.req

        def since_arrival(t: float) -> float | None:
            return round(t - stream.arrival, 6) if t else None

        rec: dict[str, Any] = {
            "event": "request_finished", "ts": round(time.time(), 3),
            "request_id": req.external_id, "finish_reason": reason,
            "prompt_tokens": req.prompt_len, "completion_tokens": req.num_output_tokens,
            "priority": req.priority, "preemptions": req.num_preemptions,
            "queue_s": since_arrival(stream.scheduled_at),
            "ttft_s": since_arrival(stream.first_token_at),
            "e2e_s": round(now - stream.arrival, 6),
        }
        if self.log_prompts and self.tokenizer is not None:
            rec["prompt"] = self.tokenizer.decode(req.token_ids[:req.prompt_len])
        return rec
