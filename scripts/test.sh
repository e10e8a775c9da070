#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then runs the linter and the whole test suite on the CPU.
# Triton kernels are tested under TRITON_INTERPRET=1 when no GPU is present.
# With no arguments the suite runs as two pytest processes: the kernel and executor tests, the
# benchmarks' tests and the service tests of the model families, quantized checkpoints, LoRA
# adapters and a 16k-token prompt (none with tight waits, timed assertions or requests that
# must overlap; one service at a time; an entry with :: is one test) at the lowest
# CPU priority beside the rest, whose services leave a core idle much of the time; the
# second's output follows the first's. With arguments: one pytest process, the arguments
# passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
BACKGROUND=(tests/kernels tests/benchmarks tests/integration/test_families.py
            tests/integration/test_quantized.py tests/integration/test_fp8.py
            tests/integration/test_lora_serving.py tests/integration/test_long_prompt.py)
IGNORE=()
for f in "${BACKGROUND[@]}"; do  # a file is ignored by the front, a test deselected
    if [[ $f == *::* ]]; then IGNORE+=("--deselect=$f"); else IGNORE+=("--ignore=$f"); fi
done
for f in tests/executor_svc/test_*.py; do  # test_server.py waits on timers: in the front
    [ "$f" = tests/executor_svc/test_server.py ] && continue
    BACKGROUND+=("$f") IGNORE+=("--ignore=$f")
done
base=$(mktemp -d)
log="$base/background.log"
nice -n 19 .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp "$base/tmp" \
    "${BACKGROUND[@]}" > "$log" 2>&1 &
background=$!
status=0
.venv/bin/python -m pytest -q --basetemp "$base/main" "${IGNORE[@]}" tests || status=$?
wait "$background" || status=$?
echo "=== ${BACKGROUND[*]:0:8} and tests/executor_svc (run beside the rest)"
cat "$log"
rm -rf "$base"
exit "$status"
