# Sourced by benchmarks/gpu.sh on the device machine, in the repo root. .whl/ (carried,
# git-ignored) holds Python 3.12 wheels (gpu.sh's header says how to make them): the
# dependencies go to /tmp/deps, pagedserve-*.whl (pure Python, stubs included) to /tmp/site.
#   PYTHONPATH=/tmp/site:/tmp/deps:<checkout>: pagedserve from the wheel, benchmarks.* and
#     tests.* from the checkout, whose pagedserve/ folder (no protos, kernels, ...) must come
#     after the wheel; a run of an older tree uses /tmp/deps alone (gpu.sh's ab part).
#   PYTHONSAFEPATH=1: `python3 -m` does not put the checkout first on sys.path.
#   /tmp/site/sitecustomize.py imports pagedserve at start-up, so a script that puts the
#     checkout first itself (benchmarks/quant/*.py, bench_kernels.py) still gets the wheel's.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$@" 2>&1 | grep -v "as the 'root' user"
}
_deps=()
for w in .whl/*.whl; do [[ $w == .whl/pagedserve-* ]] || _deps+=("$w"); done
_wheels /tmp/deps "${_deps[@]}"
_wheels /tmp/site .whl/pagedserve-*.whl
[ -d /tmp/site/pagedserve ] && [ -d /tmp/deps/grpc ] || { echo "device_env: no wheels"; exit 1; }
echo "import pagedserve  # written by benchmarks/device_env.sh" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site:/tmp/deps:$(pwd -P) PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
