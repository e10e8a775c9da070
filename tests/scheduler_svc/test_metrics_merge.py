"""metrics_merge: the engine core's /metrics is its own registry plus its API processes'
counters and histograms, summed sample by sample under the same names, as a real scrape
(prometheus_client's own exposition, parsed back) sees it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.scheduler.metrics_merge import MergedRegistry


def _registry(rpcs: dict[str, float], seconds: list[float], gauge: float) -> CollectorRegistry:
    r = CollectorRegistry()
    c = Counter("t_rpcs", "", ["code"], registry=r)
    for code, n in rpcs.items():
        c.labels(code).inc(n)
    h = Histogram("t_seconds", "", ["route"], buckets=(1, 10), registry=r)
    for v in seconds:
        h.labels("/x").observe(v)
    Gauge("t_running", "", registry=r).set(gauge)
    return r


def _samples(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_created")}


def test_api_counts_are_added_to_the_engines_and_gauges_stay_the_engines():
    engine = _registry({"OK": 1}, [], gauge=7)
    api_a = generate_latest(_registry({"OK": 2, "INVALID_ARGUMENT": 1}, [0.5, 5], gauge=3))
    api_b = generate_latest(_registry({"OK": 4}, [20], gauge=3))
    got = _samples(MergedRegistry(engine, lambda: [api_a, api_b, b"not prometheus {"]))
    assert got[("t_rpcs_total", (("code", "OK"),))] == 7
    assert got[("t_rpcs_total", (("code", "INVALID_ARGUMENT"),))] == 1  # only an API has it
    assert got[("t_seconds_bucket", (("le", "1.0"), ("route", "/x")))] == 1
    assert got[("t_seconds_bucket", (("le", "10.0"), ("route", "/x")))] == 2
    assert got[("t_seconds_bucket", (("le", "+Inf"), ("route", "/x")))] == 3
    assert got[("t_seconds_count", (("route", "/x"),))] == 3
    assert got[("t_seconds_sum", (("route", "/x"),))] == 25.5
    assert got[("t_running", ())] == 7  # a gauge is the engine's alone


def test_without_api_texts_the_engines_registry_is_served_as_it_is():
    engine = _registry({"OK": 1}, [2], gauge=1)
    assert _samples(MergedRegistry(engine, lambda: [])) == _samples(engine)


def test_only_the_named_families_are_taken_from_the_texts():
    engine = _registry({"OK": 1}, [], gauge=0)
    api = generate_latest(_registry({"OK": 2}, [0.5], gauge=0))
    got = _samples(MergedRegistry(engine, lambda: [api], frozenset({"t_seconds"})))
    assert got[("t_rpcs_total", (("code", "OK"),))] == 1  # not an API family: the engine's
    assert got[("t_seconds_count", (("route", "/x"),))] == 1
