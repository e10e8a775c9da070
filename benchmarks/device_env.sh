# Sourced by the device-call scripts: $OUT, the carried wheels (.whl: pyzmq, protobuf, grpcio,
# grpcio-health-checking, grpcio-reflection for Python 3.12) and PYTHONPATH.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
