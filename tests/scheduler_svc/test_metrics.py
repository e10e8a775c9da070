import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.metrics import BatchHistogram, Metrics
from pagedserve.scheduler.request import GenerationParams, Request
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedserve.scheduler.telemetry import Telemetry


def test_batch_histogram_exports_what_one_observe_per_value_would():
    values = [0.0, 0.001, 0.005, 0.0051, 0.1, 2.5, 99.0, 0.005]  # on, between, past the bounds
    buckets = (0.001, 0.005, 0.1, 1.0)
    texts = []
    for batched in (False, True):
        reg = CollectorRegistry()
        if batched:
            h = BatchHistogram("x", "x", {"model_name": "m"}, buckets, reg)
            h.observe_many(values[:3])
            h.observe_many(values[3:])
        else:
            child = Histogram("x", "x", ["model_name"], buckets=buckets,
                              registry=reg).labels("m")
            for v in values:
                child.observe(v)
        texts.append([line for line in generate_latest(reg).decode().splitlines()
                      if "x_created" not in line])  # served with created series off
    assert 'x_bucket{le="0.005",model_name="m"} 4.0' in texts[0]
    assert 'x_count{model_name="m"} 8.0' in texts[0]
    assert texts[0] == texts[1]


# ---------------------------------------------------------------- what a scraper receives
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_info")


@pytest.fixture(scope="module")
def served():
    """A Metrics registry with a finished request, served on a free port as the scheduler does."""
    m = Metrics("m")
    Telemetry(m).executor_joined(pb.Capacity(num_kv_blocks=10, block_size=16, dtype="float32"),
                                 prefix_caching=True)
    m.success["stop"].inc()
    m.e2e["0"].observe(0.3)
    m.rpcs.labels("m", "pagedserve.v1.Generation", "Generate", "INVALID_ARGUMENT").inc()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m.serve(port, "127.0.0.1")
    return port


def get(port, path, accept=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def families(text):
    """{family name from # TYPE: its sample names}, as Prometheus joins metadata to samples."""
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            current = line.split()[2]
            out[current] = set()
        elif line and not line.startswith("#"):
            out[current].add(line.split("{")[0].split(" ")[0])
    return out


@pytest.mark.parametrize("accept", [PROMETHEUS_ACCEPT, None], ids=["openmetrics", "text"])
def test_samples_carry_their_metadatas_name_in_both_formats(served, accept):
    status, ctype, text = get(served, "/metrics", accept)
    assert status == 200
    assert ctype.startswith("application/openmetrics-text" if accept else "text/plain")
    fams = families(text)
    for family, samples in fams.items():
        assert samples <= {family + s for s in _SUFFIXES}, (family, samples)
    names = set().union(*fams.values())
    assert {"pagedserve_request_success_total", "pagedserve_num_requests_running",
            "pagedserve_e2e_request_latency_seconds_bucket",
            "pagedserve_grpc_server_handled_total", "pagedserve_cache_config_info",
            "process_cpu_seconds_total", "python_info"} <= names
    assert not [n for n in names if ":" in n]


def test_both_formats_export_the_same_samples(served):
    om = families(get(served, "/metrics", PROMETHEUS_ACCEPT)[2])
    text = families(get(served, "/metrics")[2])
    assert set().union(*om.values()) == set().union(*text.values())


@pytest.mark.parametrize("path", ["/", "/health", "/v1/models", "/metrics/", "/favicon.ico"])
def test_the_metrics_port_serves_only_metrics(served, path):
    status, ctype, body = get(served, path, PROMETHEUS_ACCEPT)
    assert (status, ctype) == (404, "text/plain; charset=utf-8")
    assert body == "not found: this port serves /metrics only\n"


def test_a_busy_metrics_port_raises_oserror():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError):
            Metrics("m").serve(s.getsockname()[1], "127.0.0.1")


def test_scheduler_on_a_busy_metrics_port_exits_with_one_line_naming_the_flag():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "pagedserve.cli", "scheduler",
                              "--metrics-port", str(port), "--port", "0"],
                             capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr == (f"pagedserve scheduler: --metrics-port {port}: cannot listen on "
                          f"0.0.0.0:{port}: Address already in use (is another server "
                          "running?)\n")


# ---------------------------------------------------------------- kv_cache_token_utilization
def test_token_utilization_counts_a_shared_prefix_block_once():
    """Block size 4; A's 9-token prompt leaves 2 full cached blocks, which B and C (the same
    prompt) share. After one more step A holds 10 tokens (3 blocks), B and C 9 each: 5 blocks
    in use hold 8 shared + 2 + 1 + 1 = 12 tokens of 20 slots."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                          enable_prefix_caching=True)
    s = Scheduler(cfg, BlockManager(16, 4, 0, True))
    prompt = list(range(100, 109))

    def add(rid):
        s.add(Request(rid, f"r{rid}", 9, list(prompt), GenerationParams(max_tokens=100),
                      arrival_seq=rid))

    def step():
        out = s.schedule()
        done = [x.req.req_id for x in out.scheduled()
                if x.req.num_computed_tokens == x.req.num_tokens]
        s.update(done, [7] * len(done))

    add(1)
    step()
    add(2)
    add(3)
    step()
    assert [r.num_computed_tokens for r in s.running] == [10, 9, 9]
    assert s.blocks.num_blocks - s.blocks.num_free_blocks == 5
    metrics = Metrics("m")
    Telemetry(metrics).observe_scheduler(s.stats())
    sample = metrics.registry.get_sample_value
    assert sample("pagedserve_kv_cache_token_utilization", {"model_name": "m"}) == 12 / 20
    s.blocks.check_integrity()
    for rid in (1, 2, 3):
        s.finish(rid)
    assert s.blocks.num_shared_refs == 0
    s.blocks.check_integrity()
