"""docker-compose.yml: no Docker engine runs here, so validate the file and start each service's
command locally with the environment compose would give it (hostnames mapped to loopback)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration.service import free_port, scrape

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
    assert {sched["PAGEDSERVE_PORT"], sched["PAGEDSERVE_HTTP_PORT"],
            sched["PAGEDSERVE_METRICS_PORT"]} <= published
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


LORA_ONLY = {"pagedserve_lora_requests_info"}  # exported with --enable-lora only


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
        http_port = svc["scheduler"]["environment"]["PAGEDSERVE_HTTP_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as r:
            assert r.status == 200  # the OpenAI API's readiness
            r.read()  # the whole body: urlopen returns at the headers, before it is counted
        metrics_port = int(svc["scheduler"]["environment"]["PAGEDSERVE_METRICS_PORT"])
        scraped = {key.split("{")[0] for key in scrape(metrics_port)}
        # what Prometheus would get (the LoRA gauge only with --enable-lora, which the compose
        # services do not give: the real-Prometheus test's stack serves an adapter)
        assert dashboard_metric_names() - LORA_ONLY <= scraped
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in procs]
    assert codes == [0, 0]


# --- the images: Dockerfile, .dockerignore, and the compose files as compose reads them ----

def _compose_config(*files: str) -> dict:
    """The configuration as compose itself resolves it (Debian's docker-compose, or the
    docker CLI's compose plugin; scripts/setup.sh installs the first): no engine needed."""
    if shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    elif shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                   capture_output=True).returncode == 0:
        cmd = ["docker", "compose"]
    else:
        pytest.fail("no docker-compose: run scripts/setup.sh (as root it installs Debian's)")
    args = [a for f in files for a in ("-f", f)]
    out = subprocess.run([*cmd, *args, "config"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, env={k: v for k, v in os.environ.items()
                                          if not k.startswith("COMPOSE_")})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    for instr, args in _dockerfile():
        if instr == "FROM":
            image, _, name = args.partition(" AS ")
            stages[name.strip()] = [("FROM", image.strip())]
        elif stages:
            stages[list(stages)[-1]].append((instr, args))
    return stages


def test_compose_builds_the_cpu_image_and_the_override_the_cuda_one():
    for files, torch_build in ((["docker-compose.yml"], "cpu"),
                               (["docker-compose.yml", "docker-compose.cuda.yml"], "cuda")):
        svc = _compose_config(*files)["services"]
        build = svc["link-keys"]["build"]
        assert (build["target"], build["args"]) == ("pagedserve", {"TORCH": torch_build})
        assert Path(build["context"]) == ROOT
        assert {svc[n]["image"] for n in ("link-keys", "scheduler", "executor")} == \
            {f"pagedserve:{torch_build}"}
        gpus = svc["executor"].get("deploy", {}).get("resources", {}).get("reservations", {})
        assert gpus.get("devices", []) == ([{"driver": "nvidia", "count": 1,
                                             "capabilities": ["gpu"]}]
                                           if torch_build == "cuda" else [])
        assert svc["scheduler"]["healthcheck"]["test"] == [
            "CMD", "pagedserve", "health", "--readiness", "--address", "localhost:50051"]
        # the image's check asks the gRPC port, which only the scheduler has
        off = ({"disable": True}, {"test": ["NONE"]})  # compose v2's and v1's forms
        assert svc["executor"]["healthcheck"] in off and svc["link-keys"]["healthcheck"] in off


def test_dockerfile_has_a_cpu_and_a_cuda_torch_and_runs_unprivileged():
    stages = _stages()
    [arg] = [a for i, a in _dockerfile()[:1] if i == "ARG"]
    assert arg == "TORCH=cpu"  # the default build is the CPU one
    assert stages["pagedserve"][0] == ("FROM", "torch-${TORCH}")
    pin = re.search(r'"(torch==[^"]+)"', (ROOT / "scripts/setup.sh").read_text()).group(1)
    [cpu] = [a for i, a in stages["torch-cpu"] if i == "RUN"]
    assert cpu == f'pip install --index-url https://download.pytorch.org/whl/cpu "{pin}"'
    [cuda] = [a for i, a in stages["torch-cuda"] if i == "RUN"]
    assert cuda == f'pip install "{pin}"'  # PyPI's Linux build is the CUDA one
    final = stages["pagedserve"]
    [user] = [a for i, a in final if i == "USER"]
    assert user == "pagedserve" and "useradd" in dict(stages["base"])["RUN"]
    assert [i for i, _ in final].index("USER") < [i for i, _ in final].index("CMD")
    assert "chown pagedserve:pagedserve /cache /keys" in dict(stages["base"])["RUN"]
    assert "PAGEDSERVE_CACHE=/cache" in dict(stages["base"])["ENV"]


def _healthchecks() -> dict[str, list[str]]:
    [check] = [a for i, a in _dockerfile() if i == "HEALTHCHECK"]
    image = json.loads(check.split("CMD", 1)[1])
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return {"Dockerfile": image,
            "docker-compose.yml": compose["services"]["scheduler"]["healthcheck"]["test"][1:]}


@pytest.mark.parametrize("source", ["Dockerfile", "docker-compose.yml"])
def test_health_checks_import_neither_torch_nor_transformers(source):
    cmd = _healthchecks()[source]
    assert cmd[:2] == ["pagedserve", "health"]
    args = [f"127.0.0.1:{free_port()}" if a == "localhost:50051" else a for a in cmd[1:]]
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "pagedserve.cli", *args],
                         capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0]
                for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "grpc" in imported, out.stderr[-1500:]
    assert not {"torch", "triton", "transformers"} & imported
    assert out.returncode == 1  # nothing listens there: unhealthy, and fast
    assert elapsed < 5.0  # the probe runs every 10 s within a 5 s timeout


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule for a path relative to the context: the last pattern that
    matches it or a folder above it wins (`!` re-includes); `**` spans folders."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate, pat = pattern.startswith("!"), pattern.lstrip("!").strip("/")
        regex = re.escape(pat).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_build_context_small_and_what_the_image_copies():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for junk in (".venv/bin/python", ".git/HEAD", "pagedserve/__pycache__/cli.cpython-311.pyc",
                 "benchmarks/results/serve.jsonl", "benchmarks/results/archive/run.tar.gz",
                 ".whl/torch-2.13.0-cp311-none-linux_x86_64.whl", ".baseline/x", ".gpu/x",
                 ".pytest_cache/v", ".ruff_cache/v", "pagedserve.egg-info/PKG-INFO"):
        assert _ignored(junk, patterns), junk
    copied = [src for i, a in _dockerfile() if i == "COPY" for src in a.split()[:-1]]
    assert {"pagedserve", "protos", "kernels", "setup.py"} <= set(copied)
    size, files = 0, []
    for folder, dirs, names in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT).as_posix()
        rel = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if not _ignored(rel + d, patterns)]
        for name in names:
            if not _ignored(rel + name, patterns):
                files.append(rel + name)
                size += (Path(folder) / name).stat().st_size
    for src in copied:  # every file under each COPY source reaches the build
        assert any(f == src or f.startswith(src + "/") for f in files), src
        assert not _ignored(src, patterns), src
    assert "pagedserve/cli.py" in files and "kernels/__init__.py" in files
    assert size < 50 << 20, size  # this checkout's context (its .venv alone is 2.3 GB)
