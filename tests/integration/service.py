"""Starts `pagedserve serve` as a user would, on free ports, for the integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, log_path: Path, *flags: str) -> None:
        self.port, self.zmq_port, self.metrics_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--executor-bind", f"tcp://127.0.0.1:{self.zmq_port}",
               "--metrics-port", str(self.metrics_port), *flags]
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.client = Client(self.address)

    def wait_serving(self, timeout: float = 180.0) -> None:
        stub = health_pb2_grpc.HealthStub(self.client.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not serving after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until no request runs or waits; return the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["pagedserve:num_requests_running"] == 0
                    and m["pagedserve:num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = -9
        self.log.close()
        return code
