"""The standard gRPC services as real clients use them: health Watch (as load balancers and
client-side health checking do), reflection v1 and v1alpha, the API before any executor joined,
and a second server on busy ports. Python's grpc client, and Node's grpc-js where node and the
npm registry are reachable (tests/integration/node)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.scheduler.api.frontend import NO_EXECUTOR
from tests.integration.service import READINESS, Stack, free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NODE_DIR = Path(__file__).parent / "node"


@pytest.fixture(scope="module")
def node_modules() -> Path | None:
    """node_modules with grpc-js and the packages' protos (NODE_DIR/package.json), installed once
    into a cache; None when node or the npm registry is not there."""
    if not (shutil.which("node") and shutil.which("npm")):
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedserve-node"
    cache.mkdir(parents=True, exist_ok=True)
    wanted = (NODE_DIR / "package.json").read_text()
    if not (cache / "node_modules").is_dir() or (cache / "package.json").read_text() != wanted:
        (cache / "package.json").write_text(wanted)
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix",
                               str(cache)], capture_output=True, timeout=300)
        if done.returncode != 0:
            return None
    return cache / "node_modules"


def node(node_modules: Path, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(["node", str(NODE_DIR / "client.js"), *args],
                            env={**os.environ, "NODE_PATH": str(node_modules)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def test_node_client_is_installed(node_modules):
    """Says so when the Node half of these tests did not run."""
    if node_modules is None:
        pytest.skip("node or the npm registry is not reachable: Node's grpc-js not tried")


class Watch:
    """A Health/Watch stream read on a thread: (seconds since start, status name) per message."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        self.call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=600)
        self.seen: queue.Queue = queue.Queue()
        self.t0 = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for r in self.call:
                self.seen.put(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.seen.put(f"ERROR {e.code().name} {e.details()}")

    def next(self, timeout: float) -> str:
        return self.seen.get(timeout=timeout)


class NodeWatch:
    """The same through Node's grpc-js: one status name per line of the child's stdout."""

    def __init__(self, node_modules: Path, address: str, service: str) -> None:
        self.proc = node(node_modules, "watch", address, service)
        self.seen: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.seen.put(line.strip())
                                         for line in self.proc.stdout], daemon=True).start()

    def next(self, timeout: float) -> str:
        return self.seen.get(timeout=timeout)


@pytest.fixture(scope="module")
def alone(tmp_path_factory, model_dir):
    """A scheduler no executor has joined yet (the test starts and kills them)."""
    stack = Stack(tmp_path_factory.mktemp("alone"), executor=False)
    stack.wait_health(SERVING, service="")  # live
    yield stack
    stack.stop()


def test_without_an_executor_generate_and_model_info_fail_at_once(alone):
    assert alone.executor is None
    calls = {"Generate": lambda: list(alone.client.stub.Generate(build_request(text="hi"),
                                                                 timeout=60)),
             "GetModelInfo": lambda: alone.client.stub.GetModelInfo(api.GetModelInfoRequest(),
                                                                    timeout=60)}
    for name, call in calls.items():
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            call()
        took = time.monotonic() - start
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
        assert err.value.details() == NO_EXECUTOR, name
        assert took < 1.0, f"{name} took {took:.2f} s"  # not a wait for an executor
    # Tokenize needs the tokenizer only, which the scheduler has
    assert alone.client.tokenize("Hello world")


def health_list(channel: grpc.Channel) -> dict[str, str]:
    """Health/List (grpc's health.proto: every service's status), as {service: status name}."""
    statuses = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(),
                                                        timeout=10).statuses
    return {name: health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            for name, r in statuses.items()}


def test_health_watch_sees_the_executor_join_and_leave(alone, node_modules):
    """Watch streams each change; List (listed by reflection) answers every status: liveness
    ("") and readiness (the API's service name)."""
    assert health_list(alone.client.channel) == {"": "SERVING", READINESS: "NOT_SERVING"}
    watchers = {"python": Watch(alone.client.channel, READINESS)}
    liveness = Watch(alone.client.channel, "")
    if node_modules is not None:
        watchers["node"] = NodeWatch(node_modules, alone.address, READINESS)
    try:
        for name, w in watchers.items():
            assert w.next(timeout=30) == "NOT_SERVING", name
        assert liveness.next(timeout=10) == "SERVING"
        alone.executor = alone.start_executor()
        for name, w in watchers.items():
            assert w.next(timeout=180) == "SERVING", (name, alone.logs())
        assert health_list(alone.client.channel) == {"": "SERVING", READINESS: "SERVING"}
        alone.executor.kill()
        alone.executor.wait()
        killed = time.monotonic()
        for name, w in watchers.items():
            assert w.next(timeout=10) == "NOT_SERVING", name
        assert time.monotonic() - killed < 3  # its connection closed: noticed at once
        assert health_list(alone.client.channel) == {"": "SERVING", READINESS: "NOT_SERVING"}
        time.sleep(0.5)
        for name, w in [*watchers.items(), ("liveness", liveness)]:
            assert w.seen.empty(), (name, w.seen.get())  # no more changes, no error
    finally:
        for w in (*watchers.values(), liveness):
            if isinstance(w, Watch):
                w.call.cancel()
            else:
                w.proc.kill()
                w.proc.wait()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services_under_both_versions_to_node(service, node_modules,
                                                                   version):
    if node_modules is None:
        pytest.skip("node or the npm registry is not reachable")
    proc = node(node_modules, "reflect", service.address, version)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert json.loads(out) == {
        "services": ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                     "grpc.reflection.v1alpha.ServerReflection", "pagedserve.v1.Generation"],
        "files": 1}  # generate.proto, which imports nothing


def _second(command: str, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", command, *flags],
                          capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - start


@pytest.mark.parametrize("command", ["scheduler", "serve"])
@pytest.mark.parametrize("busy", ["--port", "--executor-bind", "--metrics-port"])
def test_a_second_server_on_a_busy_port_fails_at_once_naming_the_flag(service, busy, command):
    flags = {"--port": str(free_port()), "--executor-bind": f"tcp://127.0.0.1:{free_port()}",
             "--metrics-port": "0", "--http-port": "0"}
    taken = {"--port": service.port, "--executor-bind": service.zmq_port,
             "--metrics-port": service.metrics_port}[busy]
    flags[busy] = f"tcp://127.0.0.1:{taken}" if busy == "--executor-bind" else str(taken)
    done, took = _second(command, "--host", "127.0.0.1",
                         *[x for kv in flags.items() for x in kv])
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"pagedserve {command}: {busy} {flags[busy]}: cannot listen on 127.0.0.1:{taken}: "
        "Address already in use (is another server running?)"]
    assert took < 5  # checked before the server's imports (seconds on 2 busy cores)
    _, ids, _ = service.client.complete(text="Hello", max_tokens=2, temperature=0)
    assert len(ids) == 2  # the first one still serves
