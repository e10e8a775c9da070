"""docker-compose.yml: no Docker engine runs here, so validate the file and start each service's
command locally with the environment compose would give it (hostnames mapped to loopback)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_is_wired(compose):
    svc = compose["services"]
    assert set(svc) == {"scheduler", "executor"}
    assert svc["scheduler"]["image"] == svc["executor"]["image"]  # one image
    assert "build" in svc["scheduler"]
    assert (ROOT / "Dockerfile").exists()
    sched, execu = svc["scheduler"]["environment"], svc["executor"]["environment"]
    bind_port = sched["PAGEDSERVE_EXECUTOR_BIND"].rsplit(":", 1)[1]
    assert execu["PAGEDSERVE_SCHEDULER_ADDRESS"] == f"tcp://scheduler:{bind_port}"
    published = {p.split(":")[1] for p in svc["scheduler"]["ports"]}
    assert {sched["PAGEDSERVE_PORT"], sched["PAGEDSERVE_METRICS_PORT"]} <= published
    assert sched["PAGEDSERVE_MODEL"] == execu["PAGEDSERVE_MODEL"]
    assert "model-cache" in compose["volumes"]


def _local_env(env: dict[str, str]) -> dict[str, str]:
    """What the container would see, with the compose service names resolved to loopback."""
    local = {k: str(v).replace("tcp://scheduler:", "tcp://127.0.0.1:") for k, v in env.items()}
    local.pop("PAGEDSERVE_CACHE")  # /cache is the container's volume; use the user's cache
    return {**os.environ, **local, "PYTHONUNBUFFERED": "1"}


def _command(service: dict) -> list[str]:
    cmd = service["command"]
    cmd = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    assert cmd[0] == "pagedserve"  # the console script; run it with this interpreter
    return [sys.executable, "-m", "pagedserve.cli", *cmd[1:]]


def test_compose_services_run_and_answer(compose, model_dir, tmp_path):
    from pagedserve.client import Client

    svc = compose["services"]
    procs = []
    try:
        for name in ("scheduler", "executor"):
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115
            procs.append(subprocess.Popen(_command(svc[name]), env=_local_env(
                svc[name]["environment"]), stdout=log, stderr=subprocess.STDOUT))
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
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in procs]
    assert codes == [0, 0]
