"""Prometheus metrics of the scheduler (names follow vLLM's, with the pagedserve: prefix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        p = "pagedserve:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use",
                              registry=r)
        self.free_blocks = Gauge(p + "num_free_kv_blocks", "KV blocks on the free list",
                                 registry=r)
        self.total_blocks = Gauge(p + "num_kv_blocks", "KV blocks the executor holds", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted, by mode",
                                   ["mode"], registry=r)
        self.swapped = Gauge(p + "num_requests_swapped", "Requests whose KV is in host memory",
                             registry=r)
        self.priority_preemptions = Counter(
            p + "num_priority_preemptions",
            "Running requests preempted to admit a higher-priority one", registry=r)
        self.refused = Counter(p + "num_requests_refused", "Requests refused at admission",
                               ["reason"], registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found cached",
                                   registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(p + "request_success", "Finished requests", ["finished_reason"],
                               registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60),
                              registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request latency",
                             buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.step_tokens = Histogram(p + "iteration_tokens_total", "Tokens per engine step",
                                     buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                              8192), registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
