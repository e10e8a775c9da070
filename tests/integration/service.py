"""Starts `pagedserve serve` as a user would, on free ports, for the integration tests."""

from __future__ import annotations

import fcntl
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.client import Client

READINESS = "pagedserve.v1.Generation"  # health service name; "" is liveness
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
_SAMPLE = re.compile(r'^([^{\s]+)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# the service's default ports (gRPC, HTTP, metrics, executor link): tests that start it with
# its defaults (the compose layout, the CLI's checks) must find them free
DEFAULT_PORTS = frozenset({50051, 8080, 8000, 5557})
# Ports are handed out below Linux's ephemeral range (ip_local_port_range, 32768-60999 by
# default): a port found free there could be taken by any process's outgoing connection
# between free_port() closing it and the service binding it (it happened: a test's scheduler
# found its port taken). Below the range only an explicit bind can take it.
_PORTS = range(20000, 32000)
_handed_out: set[int] = set()
_rng = random.Random()  # seeded from the OS: two suites at once draw different ports
# Ports handed out by every test process on this machine (scripts/test.sh runs two pytest
# processes at once), "port@unix time" a line, under an exclusive lock: a port one process
# handed out and whose service has not bound it yet looks free to the other (it happened: an
# engine's --executor-bind found its port taken, twice, and serve gave up)
_REGISTRY = Path(tempfile.gettempdir()) / "pagedserve-test-ports"
_REGISTRY_KEEP_S = 3600.0  # a port handed out this long ago may be handed out again


def free_port() -> int:
    """A port nobody listens on, not handed out in the last hour by any test process here,
    outside the ephemeral range and the service's defaults."""
    with open(_REGISTRY, "a+") as registry:
        fcntl.flock(registry, fcntl.LOCK_EX)  # (released when the file closes)
        registry.seek(0)
        now = time.time()
        recent = {}
        for line in registry.read().split():
            port, _, when = line.partition("@")
            if port.isdigit() and when.replace(".", "", 1).isdigit() and \
                    now - float(when) < _REGISTRY_KEEP_S:
                recent[int(port)] = when
        while True:
            port = _rng.choice(_PORTS)
            if port in _handed_out or port in DEFAULT_PORTS or port in recent:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            break
        recent[port] = f"{now:.0f}"
        registry.seek(0)
        registry.truncate()
        registry.write("".join(f"{p}@{w}\n" for p, w in recent.items()))
    _handed_out.add(port)
    return port


def health(channel: grpc.Channel, service: str = READINESS) -> int | None:
    """The health status of `service`, or None if the server does not answer."""
    try:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2).status
    except grpc.RpcError:
        return None


def scrape(port: int, model_name: str = "default") -> dict[str, float]:
    """/metrics as Prometheus receives it (it asks for OpenMetrics first), as
    {name{labels}: value}; every pagedserve sample must carry model_name, which the keys leave
    out (so 'pagedserve_num_preemptions_total{mode="swap"}')."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Accept": PROMETHEUS_ACCEPT})
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, labels, value = _SAMPLE.match(line).groups()
        pairs = _LABEL.findall(labels or "")
        if name.startswith("pagedserve_"):
            assert ("model_name", model_name) in pairs, line
        rest = ",".join(f'{k}="{v}"' for k, v in pairs if k != "model_name")
        out[f"{name}{{{rest}}}" if rest else name] = float(value)
    return out


class Service:
    def __init__(self, log_path: Path, *flags: str) -> None:
        self.port, self.zmq_port, self.metrics_port = free_port(), free_port(), free_port()
        self.http_port = free_port()  # the OpenAI-compatible API: http_url + "/v1"
        self.address = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        named = dict(zip(flags, flags[1:], strict=False))  # the metrics' model_name label
        self.model_name = named.get("--served-model-name") or named.get("--model", "default")
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--executor-bind", f"tcp://127.0.0.1:{self.zmq_port}",
               "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port),
               *flags]
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.client = Client(self.address)

    def wait_serving(self, timeout: float = 180.0) -> None:
        """Wait for readiness (an executor connected)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited early:\n{self.log_path.read_text()[-3000:]}")
            if health(self.client.channel) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.5)
        raise TimeoutError(f"not serving after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port, self.model_name)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until no request runs or waits; return the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["pagedserve_num_requests_running"] == 0
                    and m["pagedserve_num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self) -> int:
        self.begin_stop()
        return self.wait_stopped()

    def begin_stop(self) -> None:
        """SIGTERM, not waiting: services stopped together drain at the same time."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> int:
        """The exit code after begin_stop (-9: it did not exit within 30 s and was killed)."""
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = -9
        self.log.close()
        return code


class Stack:
    """`pagedserve scheduler` and `pagedserve executor` as two processes, as compose runs them,
    so that a test can kill, pause or replace the executor."""

    def __init__(self, tmp: Path, *scheduler_flags: str, executor_flags: tuple[str, ...] = (),
                 link_host: str = "127.0.0.1", executor: bool = True) -> None:
        """link_host: where the scheduler binds the executor link (0.0.0.0 needs keys);
        executor: start one now (else the test calls start_executor)."""
        self.tmp = tmp
        self.executor_flags = executor_flags
        self.port, self.zmq_port, self.metrics_port = free_port(), free_port(), free_port()
        self.http_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.bind = f"tcp://{link_host}:{self.zmq_port}"
        self.scheduler = self._start("scheduler", "--host", "127.0.0.1", "--port", str(self.port),
                                     "--executor-bind", self.bind,
                                     "--metrics-port", str(self.metrics_port),
                                     "--http-port", str(self.http_port), *scheduler_flags)
        self.executors = 0
        self.executor = self.start_executor() if executor else None
        self.client = Client(self.address)

    def _start(self, command: str, *flags: str, log_name: str = "") -> subprocess.Popen:
        log = open(self.tmp / f"{log_name or command}.log", "w")  # noqa: SIM115 (child keeps it)
        return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", command, *flags],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def start_executor(self, *flags: str) -> subprocess.Popen:
        """Another executor; flags replace the stack's executor_flags."""
        self.executors += 1
        return self._start("executor", "--scheduler-address", f"tcp://127.0.0.1:{self.zmq_port}",
                           *(flags or self.executor_flags), log_name=f"executor{self.executors}")

    def wait_health(self, status: int, service: str = READINESS, timeout: float = 120.0) -> float:
        """Seconds until `service` reports status."""
        start = time.monotonic()
        while health(self.client.channel, service) != status:
            if self.scheduler.poll() is not None or time.monotonic() - start > timeout:
                raise AssertionError(f"health never became {status}:\n{self.logs()}")
            time.sleep(0.1)
        return time.monotonic() - start

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        self.client.close()
        for proc in (self.scheduler, self.executor):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
