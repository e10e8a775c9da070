#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then runs the linter and the whole test suite on the CPU.
# Triton kernels are tested under TRITON_INTERPRET=1 when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
