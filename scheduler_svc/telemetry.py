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
from collections import deque
from dataclasses import dataclass
from typing import Any

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.metrics import EXECUTOR_PHASES, SUCCESS_REASONS, Metrics
from pagedserve.scheduler.outputs import SchedulerStats
from pagedserve.scheduler.tracked import Tracked

request_log = logging.getLogger("pagedserve.requests")
_MODES = {pb.EXECUTION_MODE_CUDA_GRAPH: "cuda_graph"}  # anything else counts as eager


@dataclass(slots=True)
class StepTiming:
    num_reqs: int
    num_tokens: int
    plan_s: float  # schedule()
    round_trip_s: float  # encoding and sending -> result, including executor time
    execute_s: float  # executor-reported
    bitmask_s: float = 0.0  # filling the constrained rows' token bitmasks (after sending)


class Telemetry:
    def __init__(self, metrics: Metrics, tokenizer: Any = None, log_prompts: bool = False) -> None:
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.log_prompts = log_prompts
        self._itl: list[float] = []  # inter-token latencies of this delivery, see flush()
        self.timings: deque[StepTiming] = deque(maxlen=4096)
        self._peak_blocks_used = 0
        self._counters_seen: dict = {}  # scheduler totals already added to counters
        self._lora_labels: tuple[str, ...] | None = None  # lora_requests_info's series now
        self.lora_names: dict[int, str] = {}  # LoRA adapter id -> name (the engine's registry)

    def scheduled(self, stream: Tracked, now: float, cached_tokens: int = 0) -> None:
        """First scheduled, with cached_tokens of its prompt found in the prefix cache."""
        if not stream.scheduled_at:
            stream.scheduled_at = now
            stream.cached_tokens = cached_tokens
            self.metrics.queue_time[stream.priority_class].observe(now - stream.arrival)

    def token(self, stream: Tracked, now: float) -> None:
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
            self.metrics.itl.observe_many(self._itl)
            self._itl = []

    def finished(self, stream: Tracked, reason: str, now: float) -> None:
        """reason: one of metrics.FINISH_REASONS (a status code's name in lower case)."""
        m = self.metrics
        m.success[reason].inc()
        req = stream.req
        if req.lora_id:  # (an adapter unloaded since counts under its id)
            name = self.lora_names.get(req.lora_id, str(req.lora_id))
            m.lora_success.labels(m.model_name, name, reason).inc()
        m.request_prompt_tokens.observe(req.prompt_len)
        m.request_generation_tokens.observe(req.num_output_tokens)
        m.request_max_tokens.observe(req.params.max_tokens)
        if reason in SUCCESS_REASONS:
            m.e2e[stream.priority_class].observe(now - stream.arrival)
            m.decode_time.observe(now - stream.first_token_at)
            m.inference_time.observe(now - (stream.scheduled_at or stream.arrival))
        if request_log.isEnabledFor(logging.INFO):
            request_log.info(json.dumps(self._record(stream, reason, now)))

    def step(self, result: pb.StepResult, timing: StepTiming, num_sampled: int) -> None:
        """A step came back: timing.num_tokens tokens ran, num_sampled went to requests."""
        m = self.metrics
        self.timings.append(timing)
        m.round_trip.observe(timing.round_trip_s)
        m.step_tokens.observe(timing.num_tokens)
        m.generation_tokens.inc(num_sampled)
        m.step_time.observe(result.execute_seconds)
        m.steps[_MODES.get(result.execution_mode, "eager")].inc()
        if result.HasField("time"):
            t, host, dev = result.time, m.executor_time, m.device_time
            for phase in EXECUTOR_PHASES:
                if (seconds := getattr(t, f"{phase}_seconds")) > 0:
                    host[phase].inc(seconds)
            if t.device_busy_seconds > 0:
                dev["busy"].inc(t.device_busy_seconds)
            if t.device_gap_seconds > 0:
                dev["gap"].inc(t.device_gap_seconds)
            if t.cpu_seconds > 0:
                m.executor_cpu.inc(t.cpu_seconds)
        if result.device_memory_total_bytes:
            m.device_memory_used.set(result.device_memory_used_bytes)
            m.device_memory_total.set(result.device_memory_total_bytes)

    def retry_after_s(self, queued_tokens: int) -> float:
        """How long a queue of queued_tokens should take to drain at the recent step rate."""
        recent = list(self.timings)[-64:]
        busy = sum(t.round_trip_s for t in recent)
        rate = sum(t.num_tokens for t in recent) / busy if busy > 0 else 0.0
        return max(1.0, min(60.0, queued_tokens / rate if rate > 0 else 1.0))

    def executor_joined(self, cap: pb.Capacity, prefix_caching: bool) -> None:
        m = self.metrics
        m.cache_config.clear()  # the previous executor's
        m.cache_config.labels(m.model_name, cap.block_size, cap.num_kv_blocks,
                              cap.num_swap_blocks, cap.kv_cache_dtype, prefix_caching).set(1)
        m.total_blocks.set(cap.num_kv_blocks)
        m.kv_capacity_tokens.set(cap.num_kv_blocks * cap.block_size)
        m.weight_bytes.set(cap.weight_bytes)

    def observe_scheduler(self, st: SchedulerStats) -> None:
        """Gauges from the scheduler's state; its running totals become counter increments."""
        m = self.metrics
        m.running.set(st.running)
        m.waiting.set(st.waiting)
        if st.max_loras:
            self._lora_info(st)
        m.swapped.set(st.swapped)
        m.kv_usage.set(1.0 - st.free_blocks / st.num_blocks)
        m.free_blocks.set(st.free_blocks)
        used = st.num_blocks - st.free_blocks
        if used:
            util = st.kv_tokens_held / (used * st.block_size)
            m.kv_token_util.set(util)
            if used >= self._peak_blocks_used:
                self._peak_blocks_used = used
                m.kv_token_util_at_peak.set(util)
        seen = self._counters_seen
        for counter, value in ((m.preemptions["swap"], st.swap_preemptions),
                               (m.preemptions["recompute"], st.preemptions - st.swap_preemptions),
                               (m.priority_preemptions, st.priority_preemptions),
                               (m.prefix_queries, st.prefix_queried_tokens),
                               (m.prefix_hits, st.prefix_hit_tokens),
                               (m.held_chunks, st.held_chunks),
                               (m.spec_drafts, st.spec_drafts),
                               (m.spec_draft_tokens, st.spec_draft_tokens),
                               (m.spec_accepted_tokens, st.spec_accepted_tokens),
                               *((m.spec_accepted_per_pos[str(pos)], n)
                                 for pos, n in enumerate(st.spec_accepted_per_pos))):
            counter.inc(value - seen.get(counter, 0))
            seen[counter] = value

    def _lora_info(self, st: SchedulerStats) -> None:
        """One series, replaced when the adapters in use change (the Inference Extension's
        endpoint picker reads the newest)."""
        labels = (self.metrics.model_name, str(st.max_loras), ",".join(st.running_lora),
                  ",".join(st.waiting_lora))
        if labels == self._lora_labels:
            return
        if self._lora_labels is not None:
            self.metrics.lora_info.remove(*self._lora_labels)
        self.metrics.lora_info.labels(*labels).set(time.time())
        self._lora_labels = labels

    def _record(self, stream: Tracked, reason: str, now: float) -> dict[str, Any]:
        req = stream.req

        def since_arrival(t: float) -> float | None:
            return round(t - stream.arrival, 6) if t else None

        rec: dict[str, Any] = {
            "event": "request_finished", "ts": round(time.time(), 3),
            "request_id": req.external_id, "finish_reason": reason,
            "prompt_tokens": req.prompt_len, "completion_tokens": req.num_output_tokens,
            "cached_tokens": stream.cached_tokens,
            "priority": req.priority, "preemptions": req.num_preemptions,
            "queue_s": since_arrival(stream.scheduled_at),
            "ttft_s": since_arrival(stream.first_token_at),
            "e2e_s": round(now - stream.arrival, 6),
        }
        if stream.tenant:
            rec["tenant"] = stream.tenant
        if self.log_prompts and self.tokenizer is not None:
            rec["prompt"] = self.tokenizer.decode(req.token_ids[:req.prompt_len])
        return rec
