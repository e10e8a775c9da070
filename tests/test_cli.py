"""The `pagedserve` command as a user meets it: client commands start without torch, every flag
explains itself and shows its default, the slow start phases say what they do, and the common
mistakes (no server running, a wrong --model) get one line and a non-zero exit, quickly."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pagedserve import cli
from tests.integration.service import free_port

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "triton", "transformers")
PARSER = cli._parser({}, {})
SUB = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction))
COMMANDS = sorted(SUB.choices)


def pagedserve(*argv: str, timeout: float = 120, **kw) -> tuple[subprocess.CompletedProcess,
                                                                 float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pagedserve.cli", *argv], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT, **kw)
    return out, time.monotonic() - start


def test_the_commands_are_the_ones_tested():
    assert COMMANDS == ["api", "engine", "executor", "generate", "health", "keys", "quantize",
                        "scheduler", "serve"]


def test_serve_refuses_tenant_quotas_split_over_api_processes(tmp_path):
    """Each API process would count a tenant's quotas on its own: with two, refused at once,
    before any process starts; without quotas, or with one API process, they are fine."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  free: {priority: [0, 2], max_concurrent: 4}\n"
                    "  open: {priority: [0, 0]}\nkeys:\n  - {key: sk-1, tenant: free}\n")
    ports = [a for flag in ("--port", "--http-port", "--metrics-port")
             for a in (flag, str(free_port()))]
    out, _ = pagedserve("serve", "--api-server-count", "2", "--api-keys", str(keys), *ports,
                        "--executor-bind", f"tcp://127.0.0.1:{free_port()}", timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "pagedserve serve: --api-server-count 2: the tenants free have max_concurrent or "
        "tokens_per_minute, which each API process would count on its own; use "
        "--api-server-count 1 (or 0) with quotas")


def _client_runs(tmp: Path) -> list[list[str]]:
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    return [["--help"], *([c, "--help"] for c in COMMANDS),
            ["health", "--address", nobody], ["generate", "hi", "--address", nobody],
            ["keys", str(tmp), "--name", "probe"]]


def test_client_commands_and_help_import_neither_torch_triton_nor_transformers(tmp_path):
    probe = ("import json, sys\n"
             "from pagedserve import cli\n"
             "try:\n    code = cli.main(sys.argv[1:])\n"
             "except SystemExit as e:\n    code = e.code\n"
             f"print(json.dumps([code, sorted(m for m in {HEAVY!r} if m in sys.modules)]))")
    for argv in _client_runs(tmp_path):
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        code, heavy = json.loads(out.stdout.splitlines()[-1])
        assert heavy == [], (argv, heavy)
        assert code in (0, 1), (argv, out.stderr[-2000:])  # 1: health/generate, no server
    assert (tmp_path / "probe.key").exists()


def _help_entries(parser: argparse.ArgumentParser, text: str) -> dict[str, str]:
    """Each action's part of the --help text (its invocation up to the next one's)."""
    formatter = parser._get_formatter()
    actions = [a for group in parser._action_groups for a in group._group_actions]
    starts, pos = [], 0
    for action in actions:
        pos = text.index("  " + formatter._format_action_invocation(action), pos)
        starts.append(pos)
    return {a.dest: " ".join(text[s:e].split())
            for a, s, e in zip(actions, starts, [*starts[1:], len(text)], strict=True)}


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_flag_has_help_and_its_default_shows_in_help(command, capsys):
    parser = PARSER if command is None else SUB.choices[command]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"] if command is None else [command, "--help"])
    assert exit_.value.code == 0
    entries = _help_entries(parser, capsys.readouterr().out)
    for action in parser._actions:
        if action.dest == "help" or isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help and action.help.strip(), (command, action.dest)
        if action.option_strings and not action.required:
            assert f"(default: {action.default})" in entries[action.dest], \
                (command, action.dest, entries[action.dest])


@pytest.mark.parametrize("command", ["health", "generate"])
def test_no_server_running_is_one_line_fast(command):
    address = f"127.0.0.1:{free_port()}"
    out, elapsed = pagedserve(*(["generate", "hi"] if command == "generate" else [command]),
                              "--address", address)
    assert out.returncode == 1
    assert out.stdout.strip() == ""
    assert out.stderr.strip() == (
        f"pagedserve: error: no server is running at {address} (connection refused); start "
        f"one with `pagedserve serve`, or give --address of a running one")
    assert elapsed < 3.0  # ~0.3 s here: no torch, and the call does not wait for a connection


def test_a_server_that_drops_the_connection_is_not_called_missing():
    """Something listens but ends the connection (as a TLS server does to a plain client):
    the one line must not say that no server runs there."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def drop() -> None:
        with contextlib.suppress(OSError):
            while True:
                listener.accept()[0].close()

    threading.Thread(target=drop, daemon=True).start()
    try:
        out, _ = pagedserve("health", "--address", address)
    finally:
        listener.close()
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"pagedserve: error: cannot connect to {address} (is it a TLS "
                           "server? then give --tls or --tls-ca): ")


def test_an_unresolvable_host_is_one_line():
    out, _ = pagedserve("health", "--address", "no-such-host.invalid:50051")
    assert out.returncode == 1
    assert out.stderr.strip() == "pagedserve: error: cannot resolve the host of " \
                                 "no-such-host.invalid:50051"


@pytest.mark.parametrize("command", ["serve", "scheduler", "executor"])
def test_a_bad_model_path_is_one_line_before_anything_loads(command, tmp_path):
    out, elapsed = pagedserve(command, "--model", "/nonexistent")
    assert out.returncode == 2
    assert out.stderr.strip() == ("pagedserve: error: model /nonexistent: no such file or "
                                  "directory (give an HF directory, a .gguf file, or 'default')")
    assert elapsed < 4.0  # checked before the server modules import (5 s for the scheduler)
    out, _ = pagedserve(command, "--model", str(tmp_path))
    assert (out.returncode, out.stderr.strip()) == (
        2, f"pagedserve: error: model {tmp_path}: the directory has no config.json")


def _stderr_until(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """stderr's lines up to the one with `marker`. Reads the pipe's descriptor, not the file
    object: its readline() may pull several lines into its own buffer, where select() cannot
    see them, and the loop would then wait for output that has already arrived."""
    lines: list[str] = []
    fd, pending = proc.stderr.fileno(), b""
    deadline = time.monotonic() + timeout
    while not any(marker in line for line in lines):
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
        if select.select([fd], [], [], 1.0)[0]:
            *done, pending = (pending + os.read(fd, 1 << 16)).split(b"\n")
            lines += [line.decode(errors="replace") + "\n" for line in done]
    return lines


def _phases(lines: list[str]) -> list[tuple[str, str]]:
    """(phase, 'start' or the duration) from the pagedserve.progress lines, in order."""
    out = []
    for line in lines:
        if " pagedserve.progress: " not in line:
            continue
        text = line.split(" pagedserve.progress: ", 1)[1].strip()
        if text.endswith(" ..."):
            out.append((text[:-4], "start"))
        else:
            what, _, done = text.rpartition(": done in ")
            assert done.endswith(" s") and float(done[:-2]) >= 0, line
            out.append((what, "end"))
    return out


def _start_phases(flags: list[str], timeout: float, **popen) -> list[str]:
    """An executor started with `flags` until it connects, then stopped: the first word of each
    progress phase it reported, in order; each phase must have a start and then an end line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "executor", *flags,
         "--scheduler-address", f"tcp://127.0.0.1:{free_port()}"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=ROOT, **popen)
    try:
        lines = _stderr_until(proc, "connecting to", timeout=timeout)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    phases = _phases(lines)
    assert all(phases[i][1] == "start" and phases[i + 1] == (phases[i][0], "end")
               for i in range(0, len(phases), 2)), phases
    return [what.split(" ")[0] for what, _ in phases[::2]]


@pytest.fixture
def open_cache():
    """An empty cache folder that other users may enter (pytest's tmp_path is 0700)."""
    cache = Path(tempfile.mkdtemp(prefix="pagedserve-cache-"))
    cache.chmod(0o755)
    yield cache
    shutil.rmtree(cache)


def test_first_start_reports_each_phase_and_leaves_a_cache_others_can_read(open_cache):
    """The executor's first start with an empty cache: conversion, loading and warm-up each
    get a start and an end line (profiling and graph capture are CUDA-only, wrapped alike);
    the converted model is 0755/0644 under umask 022, readable by another user."""
    cache = open_cache
    names = _start_phases(["--model", "default", "--device", "cpu"], timeout=300,
                          env={**os.environ, "PAGEDSERVE_CACHE": str(cache)},
                          umask=0o022)  # set by the child, no Python runs between fork and exec
    assert names == ["converting", "loading", "warm-up"]
    [model] = (cache / "models").iterdir()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [model, *model.rglob("*")]}
    assert modes[model.name] == 0o755
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(modes)
    assert {m for name, m in modes.items() if name != model.name} == {0o644}
    if os.geteuid() == 0:  # read it as an unprivileged user, as a service user would
        read = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "head", "-c", "16", str(model / "model.safetensors")],
                              capture_output=True, timeout=30)
        assert read.returncode == 0, read.stderr


def test_a_cuda_start_reports_profiling_and_graph_capture():
    """On CUDA the executor's start also reports the memory profile and the CUDA-graph capture,
    each with a start and an end line (the CPU start above has neither phase)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    names = _start_phases(["--model", str(ROOT / "benchmarks/models/smollm2-135m"),
                           "--load-format", "random", "--device", "cuda"], timeout=600)
    assert {"loading", "profiling", "warm-up", "capturing"} <= set(names), names
