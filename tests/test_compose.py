"""docker-compose.yml: no Docker engine runs here, so validate the file and start each service's
command locally with the environment compose would give it (hostnames mapped to loopback)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.service import scrape

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_is_wired(compose):
    svc = compose["services"]
    assert set(svc) == {"link-keys", "scheduler", "executor", "prometheus", "grafana"}
    images = {svc[name]["image"] for name in ("link-keys", "scheduler", "executor")}
    assert len(images) == 1 and "build" in svc["link-keys"]  # one image, built once
    assert (ROOT / "Dockerfile").exists()
    sched, execu = svc["scheduler"]["environment"], svc["executor"]["environment"]
    # the link binds every interface, so it has keys, from the volume link-keys fills first
    assert sched["PAGEDSERVE_EXECUTOR_BIND"].startswith("tcp://0.0.0.0:")
    for name in ("scheduler", "executor"):
        assert "link-keys:/keys:ro" in svc[name]["volumes"]
    assert svc["scheduler"]["depends_on"]["link-keys"]["condition"] == \
        "service_completed_successfully"
    assert "link-keys:/keys" in svc["link-keys"]["volumes"]
    bind_port = sched["PAGEDSERVE_EXECUTOR_BIND"].rsplit(":", 1)[1]
    assert execu["PAGEDSERVE_SCHEDULER_ADDRESS"] == f"tcp://scheduler:{bind_port}"
    published = {p.split(":")[1] for p in svc["scheduler"]["ports"]}
    assert {sched["PAGEDSERVE_PORT"], sched["PAGEDSERVE_METRICS_PORT"]} <= published
    assert sched["PAGEDSERVE_MODEL"] == execu["PAGEDSERVE_MODEL"]
    assert "model-cache" in compose["volumes"]
    assert "--readiness" in svc["scheduler"]["healthcheck"]["test"]


def _mounts(service: dict) -> dict[str, Path]:
    """container path -> the repository file or folder mounted there."""
    out = {}
    for volume in service["volumes"]:
        src, dst = volume.split(":")[:2]
        if src.startswith("./"):
            assert (ROOT / src).exists(), src
            out[dst] = ROOT / src
    return out


def test_prometheus_scrapes_the_schedulers_metrics_port(compose):
    svc = compose["services"]
    prom = svc["prometheus"]
    [config_file] = [a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file")]
    scrape = yaml.safe_load(_mounts(prom)[config_file].read_text())
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    metrics_port = svc["scheduler"]["environment"]["PAGEDSERVE_METRICS_PORT"]
    assert targets == [f"scheduler:{metrics_port}"]  # the executor reports through it
    assert all(job.get("metrics_path", "/metrics") == "/metrics"
               for job in scrape["scrape_configs"])


def test_grafana_provisions_the_datasource_and_dashboard(compose):
    svc = compose["services"]
    mounts = _mounts(svc["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load(
        (provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    prom_port = svc["prometheus"]["ports"][0].split(":")[1]
    assert source["url"] == f"http://prometheus:{prom_port}"
    [provider] = yaml.safe_load(
        (provisioning / "dashboards/pagedserve.yml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    dash = json.loads((dashboards / "pagedserve.json").read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("requests finished", "time to first token", "inter-token", "running",
                  "kv cache", "preemptions", "gpu memory"):
        assert topic in titles


def dashboard_metric_names() -> set[str]:
    dash = json.loads((ROOT / "deploy/grafana/dashboards/pagedserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    return {name for e in exprs for name in re.findall(r"pagedserve_[a-zA-Z0-9_:]+", e)}


def test_dashboard_uses_only_exported_metrics():
    from pagedserve.scheduler.metrics import Metrics

    names = dashboard_metric_names()
    assert len(names) > 15
    assert names <= Metrics("m").names(), names - Metrics("m").names()


def _local_env(env: dict[str, str], keys: Path) -> dict[str, str]:
    """What the container would see, with the compose service names resolved to loopback and
    the link-keys volume at `keys`."""
    local = {k: str(v).replace("tcp://scheduler:", "tcp://127.0.0.1:").replace("/keys", str(keys))
             for k, v in env.items()}
    local.pop("PAGEDSERVE_CACHE")  # /cache is the container's volume; use the user's cache
    return {**os.environ, **local, "PYTHONUNBUFFERED": "1"}


def _command(service: dict) -> list[str]:
    cmd = service["command"]
    cmd = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    assert cmd[0] == "pagedserve"  # the console script; run it with this interpreter
    return [sys.executable, "-m", "pagedserve.cli", *cmd[1:]]


def _make_keys(service: dict, keys: Path) -> None:
    """The link-keys service's shell command, with this interpreter and `keys` for /keys."""
    shell, flag, script = service["command"]
    assert (shell, flag) == ("sh", "-c")
    cli = f"{shlex.quote(sys.executable)} -m pagedserve.cli"
    script = script.replace("pagedserve keys", f"{cli} keys").replace("/keys", str(keys))
    subprocess.run([shell, flag, script], check=True, timeout=120)


def test_compose_services_run_and_answer(compose, model_dir, tmp_path):
    from pagedserve.client import Client

    svc = compose["services"]
    keys = tmp_path / "keys"
    _make_keys(svc["link-keys"], keys)
    procs = []
    try:
        for name in ("scheduler", "executor"):
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115
            procs.append(subprocess.Popen(_command(svc[name]), env=_local_env(
                svc[name]["environment"], keys), stdout=log, stderr=subprocess.STDOUT))
        port = svc["scheduler"]["environment"]["PAGEDSERVE_PORT"]
        health = [sys.executable, "-m", "pagedserve.cli", "health", "--address",
                  f"127.0.0.1:{port}"]
        deadline = time.monotonic() + 120
        while subprocess.run(health, capture_output=True).returncode != 0:
            assert all(p.poll() is None for p in procs), (tmp_path / "scheduler.log").read_text()
            assert time.monotonic() < deadline, "compose services never became healthy"
            time.sleep(1)
        with Client(f"127.0.0.1:{port}") as client:
            text, _, _ = client.complete(chat=[("user", "What is the capital of France?")],
                                         temperature=0, max_tokens=16)
        assert text == "The capital of France is Paris."
        metrics_port = int(svc["scheduler"]["environment"]["PAGEDSERVE_METRICS_PORT"])
        scraped = {key.split("{")[0] for key in scrape(metrics_port)}
        assert dashboard_metric_names() <= scraped  # what Prometheus would get
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in procs]
    assert codes == [0, 0]
