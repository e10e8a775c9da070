"""Prometheus metrics of the scheduler: vLLM's names with the prefix pagedserve_ for vllm:.

The prefix has no colon: served as OpenMetrics (which Prometheus asks for first) prometheus_client
escapes a colon to an underscore in the samples but not in HELP/TYPE, so a scraper would store
`vllm:x`-style names under another name than their metadata says.

Every series carries `model_name` (the served model name). Per-request latencies that depend on
scheduling order (queue time, TTFT, end-to-end) also carry `priority`: the request's priority
clamped to PRIORITY_CLASSES, so "-2" stands for -2 and below and "2" for 2 and above (five
series at most per histogram, whatever clients send). The executor's figures (step time, device
memory, eager vs CUDA-graph steps) arrive with each step result and are exported here: the
scheduler is the only scrape target.

Children are bound once here, so the engine's hot path does no label lookups.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Callable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagedserve.scheduler import metrics_http

PREFIX = "pagedserve_"
PRIORITY_CLASSES = ("-2", "-1", "0", "1", "2")
# stop, length: finished; abort: the client cancelled or left; deadline_exceeded: its gRPC
# deadline passed; the rest: the failing status (executor lost, step failed, drained)
FINISH_REASONS = ("stop", "length", "abort", "deadline_exceeded", "unavailable", "internal")
SUCCESS_REASONS = ("stop", "length")
PREEMPTION_MODES = ("recompute", "swap")
EXECUTION_MODES = ("eager", "cuda_graph")
# the scheduler's step loop while steps are in flight (engine.Engine._step_loop): planning and
# its bookkeeping; encoding and sending plans and bitmasks; detokenizing and queueing tokens
# for the streams; applying results; waiting for the executor's result; and the other tasks of
# the process's event loop (gRPC and HTTP handlers writing streams) when they hold it
LOOP_PHASES = ("plan", "send", "deliver", "update", "bitmask", "await_executor",
               "other_tasks")
# the executor's host phases: pb.ExecutorTime's <phase>_seconds fields (and
# pagedserve.executor.step_clock.HOST_PHASES; a test holds the three together)
EXECUTOR_PHASES = ("idle", "wait", "recv", "launch", "bitmask", "finish", "send")
DEVICE_STATES = ("busy", "gap")
REFUSAL_REASONS = ("queue_full", "unauthenticated")
TENANT_OUTCOMES = ("admitted", "denied", "throttled")  # denied: priority; throttled: a quota
# the families the API front ends count (RPCs, HTTP, tenants, refusals of bad keys); with the
# engine core in a process of its own, the API processes send theirs to it (engine_host.py)
API_FAMILIES = frozenset(PREFIX + name for name in (
    "grpc_server_handled", "http_requests", "http_request_duration_seconds", "tenant_requests",
    "tenant_generation_tokens", "num_requests_refused", "api_process_cpu_seconds"))
_LATENCY = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
_LONG = (.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKENS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1 .. 5M, as vLLM's 1-2-5
_ITL = (.005, .01, .02, .03, .05, .075, .1, .15, .2, .3, .5, 1, 2.5)


class BatchHistogram(Collector):
    """A histogram fed a batch of values at a time: one Histogram.observe() per token (a lock
    and a bucket search each) is a large share of the scheduler's host time per step with
    hundreds of running requests. Counts live here and reach the registry through the
    public custom-collector API."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], buckets: tuple,
                 registry: CollectorRegistry) -> None:
        self._name, self._doc, self._labels = name, doc, labels
        self._bounds = [float(b) for b in buckets] + [math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # the scrape runs on the HTTP server's thread
        registry.register(self)

    def observe_many(self, values: list[float]) -> None:
        counts = [0] * len(self._bounds)
        for v in values:
            counts[bisect.bisect_left(self._bounds, v)] += 1  # first bound >= v, as observe()
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
            self._sum += sum(values)

    def observe(self, value: float) -> None:
        self.observe_many([value])

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=list(self._labels))
        cumulative = list(itertools.accumulate(counts))
        family.add_metric(list(self._labels.values()),
                          [(floatToGoString(b), c) for b, c in zip(self._bounds, cumulative,
                                                                    strict=True)],
                          sum_value=total)
        return [family]


class _Children(dict):
    """A family's children by label value, bound up front (the hot path does no label lookup);
    a value not foreseen (say a new failure status) is bound when first used, not an error."""

    def __init__(self, bind: Callable[[str], object], values: tuple[str, ...]) -> None:
        super().__init__((v, bind(v)) for v in values)
        self._bind = bind

    def __missing__(self, value: str) -> object:
        child = self[value] = self._bind(value)
        return child


def priority_class(priority: int) -> str:
    return str(max(-2, min(2, priority)))


class Metrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None,
                 tenants: tuple[str, ...] = ()) -> None:
        """tenants: the API keys file's tenant names (the only values of the tenant label)."""
        r = self.registry = registry or CollectorRegistry()
        m = model_name
        self.model_name = m

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ["model_name"], registry=r).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=r).labels(m)

        def by(kind: type, name: str, doc: str, label: str, values: tuple[str, ...],
               **kw: object) -> dict[str, object]:
            family = kind(PREFIX + name, doc, ["model_name", label], registry=r, **kw)
            return _Children(lambda v: family.labels(m, v), values)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=r).labels(m)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        # every API process's CPU time, summed (serve --api-server-count N >= 1): the engine
        # core's own is process_cpu_seconds_total; 0 while the API runs in the scheduler process
        self.api_process_cpu = counter("api_process_cpu_seconds",
                                       "CPU seconds of the API processes (every thread)")
        self.waiting = gauge("num_requests_waiting", "Requests queued")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV is in host memory")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.free_blocks = gauge("num_free_kv_blocks", "KV blocks on the free list")
        self.total_blocks = gauge("num_kv_blocks", "KV blocks the executor holds")
        self.kv_capacity_tokens = gauge("kv_cache_capacity_tokens",
                                        "Tokens the executor's KV blocks hold")
        self.weight_bytes = gauge("model_weight_bytes",
                                  "Bytes of model parameters on the executor's device")
        self.kv_token_util = gauge("kv_cache_token_utilization",
                                   "Tokens the KV blocks in use hold (a block shared by "
                                   "requests through the prefix cache counted once) / their "
                                   "capacity; 1 minus this is what partly filled blocks waste")
        self.kv_token_util_at_peak = gauge(
            "kv_cache_token_utilization_at_peak",
            "kv_cache_token_utilization when the most KV blocks were in use")
        self.preemptions = by(Counter, "num_preemptions", "Requests preempted, by mode", "mode",
                              PREEMPTION_MODES)
        self.priority_preemptions = counter(
            "num_priority_preemptions", "Running requests preempted to admit a higher-priority one")
        self.held_chunks = counter(
            "num_prefill_chunks_held", "Chunks of partly prefilled prompts held back while "
            "requests decode (--long-prefill-decode-share)")
        self.refused = by(Counter, "num_requests_refused", "Requests refused at admission",
                          "reason", REFUSAL_REASONS)
        per_tenant = Counter(PREFIX + "tenant_requests", "Requests by tenant and outcome",
                             ["model_name", "tenant", "outcome"], registry=r)
        self.tenant_requests = {t: {o: per_tenant.labels(m, t, o) for o in TENANT_OUTCOMES}
                                for t in tenants}
        generated = Counter(PREFIX + "tenant_generation_tokens", "Tokens generated, by tenant",
                            ["model_name", "tenant"], registry=r)
        self.tenant_generation_tokens = {t: generated.labels(m, t) for t in tenants}
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found cached")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted")
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Speculative decoding: drafts verified (one per drafted "
                                   "request per step)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Speculative decoding: draft tokens proposed")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Speculative decoding: draft tokens accepted")
        self.spec_accepted_per_pos = by(
            Counter, "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft (0: first)",
            "position", ())
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = by(Counter, "request_success",
                          "Requests that left the engine, by finish reason: stop, length; abort "
                          "(the client cancelled or left), deadline_exceeded, or a failure's "
                          "status (unavailable, internal)", "finished_reason", FINISH_REASONS)
        self.lora_success = Counter(PREFIX + "lora_request_success",
                                    "Requests of a LoRA adapter that left the engine, by "
                                    "adapter and finish reason (as request_success)",
                                    ["model_name", "lora_name", "finished_reason"], registry=r)
        self.rpcs = Counter(PREFIX + "grpc_server_handled",
                            "RPCs completed, by method and gRPC status code (OK, or why the "
                            "request was rejected or failed, e.g. INVALID_ARGUMENT)",
                            ["model_name", "grpc_service", "grpc_method", "grpc_code"], registry=r)
        self.http_requests = Counter(PREFIX + "http_requests",
                                     "HTTP API requests answered, by route (other: a path not "
                                     "served) and status code (499: the client left before "
                                     "the response began)",
                                     ["model_name", "route", "status"], registry=r)
        self.http_duration = Histogram(PREFIX + "http_request_duration_seconds",
                                       "HTTP API requests, arrival to the response's last byte "
                                       "(a stream's end)", ["model_name", "route"],
                                       buckets=_LONG, registry=r)
        self.request_prompt_tokens = hist("request_prompt_tokens",
                                          "Prompt tokens of each request that left the engine",
                                          _TOKENS)
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Tokens generated for each request that left the engine",
            _TOKENS)
        self.request_max_tokens = hist("request_params_max_tokens",
                                       "max_tokens of each request that left the engine (the "
                                       "room up to max_model_len when unset)", _TOKENS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "First scheduled to last token, per finished request", _LONG)
        self.lora_info = Gauge(PREFIX + "lora_requests_info",
                               "LoRA (vLLM's lora_requests_info): the adapters of the running "
                               "and of the waiting requests, comma-separated, and the device "
                               "slots; its value is when that last changed (Unix seconds), one "
                               "series at a time", ["model_name", "max_lora",
                                                    "running_lora_adapters",
                                                    "waiting_lora_adapters"], registry=r)
        self.cache_config = Gauge(PREFIX + "cache_config_info",
                                  "The KV cache of the executor now joined (value 1); vLLM's "
                                  "label names: num_gpu_blocks are device blocks, num_cpu_blocks "
                                  "swap blocks in host memory",
                                  ["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                                   "cache_dtype", "enable_prefix_caching"], registry=r)
        self.queue_time = by(Histogram, "request_queue_time_seconds",
                             "Arrival to first scheduled", "priority", PRIORITY_CLASSES,
                             buckets=_LATENCY)
        self.ttft = by(Histogram, "time_to_first_token_seconds", "Arrival to first token",
                       "priority", PRIORITY_CLASSES, buckets=_LATENCY)
        self.e2e = by(Histogram, "e2e_request_latency_seconds", "Arrival to last token",
                      "priority", PRIORITY_CLASSES, buckets=_LONG)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "First scheduled to first token", _LATENCY)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token",
                                _LONG)
        self.itl = BatchHistogram(PREFIX + "inter_token_latency_seconds",
                                  "Time between a request's tokens", {"model_name": m}, _ITL, r)
        self.step_tokens = hist("iteration_tokens_total", "Tokens per engine step",
                                (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
        self.step_time = hist("executor_step_seconds", "Executor time per step (its report)",
                              (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10))
        self.plan_time = hist("scheduler_plan_seconds", "Scheduler time to plan a step",
                              (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1))
        self.bitmask_time = hist("grammar_bitmask_seconds",
                                 "Scheduler time filling a step's token bitmasks (structured "
                                 "outputs; steps with a constrained request only)",
                                 (.00001, .00005, .0001, .00025, .0005, .001, .0025, .005, .01,
                                  .025))
        self.accept_time = hist("grammar_accept_seconds",
                                "Scheduler time advancing the constrained requests' grammars by "
                                "a step's tokens (structured outputs; steps with one only)",
                                (.00001, .00005, .0001, .00025, .0005, .001, .0025, .005, .01,
                                 .025))
        self.round_trip = hist("step_round_trip_seconds",
                               "Plan sent to result received, per step (the executor's time "
                               "plus the link)",
                               (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10))
        self.steps = by(Counter, "executor_steps", "Executor steps, by how the forward ran",
                        "mode", EXECUTION_MODES)
        self.loop_time = by(Counter, "scheduler_loop_seconds",
                            "The scheduler's step loop while steps are in flight, by phase: "
                            "plan, send, deliver (detokenize, queue for streams), update "
                            "(apply results), bitmask (fill and send the token bitmasks a result "
                            "let through), await_executor, other_tasks (the event loop's "
                            "other work, e.g. gRPC writes)", "phase", LOOP_PHASES)
        self.executor_time = by(Counter, "executor_host_seconds",
                                "The executor process's time, by phase: idle (no step "
                                "launched, waiting for a plan; a wait for work left out), wait "
                                "(a step launched, waiting for the next plan or the device), "
                                "recv, launch, bitmask (waiting for token bitmasks), finish "
                                "(waiting for the device to end a step, reading its tokens "
                                "back), send",
                                "phase", EXECUTOR_PHASES)
        self.device_time = by(Counter, "executor_device_seconds",
                              "CUDA: device time from events around each launch's device work: "
                              "busy, or gap (nothing queued between launches; a wait for work "
                              "left out)",
                              "state", DEVICE_STATES)
        self.executor_cpu = counter("executor_cpu_seconds",
                                    "CPU time of the executor process (every thread)")
        self.device_memory_used = gauge(
            "device_memory_used_bytes",
            "Executor device memory in use (CUDA: the card's; CPU: the process's RSS)")
        self.device_memory_total = gauge(
            "device_memory_total_bytes", "Executor device memory in all (CPU: host memory)")
        self.executor_connected = gauge("executor_connected",
                                        "1 while a warmed-up executor is connected")
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)  # process_*, python_info, python_gc_*: the process's own

    def names(self) -> set[str]:
        """Every sample name this registry can export, including families with no labelled
        child yet (e.g. for checking dashboards); *_created series are not served."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        return {family.name + s for family in self.registry.collect()
                for s in suffixes.get(family.type, ("",))}

    def serve(self, port: int, host: str = "0.0.0.0", certfile: str = "",
              keyfile: str = "") -> Callable[[], None]:
        """/metrics over HTTP, or HTTPS with certfile and keyfile (OSError: the port cannot be
        bound; ValueError: the files cannot be used). Returns what re-reads those files for new
        connections (a no-op over HTTP)."""
        disable_created_metrics()  # no *_created series: they double what Prometheus stores
        _, reload = metrics_http.start(self.registry, port, host, certfile, keyfile)
        return reload
