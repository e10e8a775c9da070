#!/usr/bin/env bash
# Makes .whl/ (git-ignored; carried to the device machine, where benchmarks/device_env.sh
# installs it): the dependencies the device lacks as Python 3.12 wheels, then pagedserve's own
# wheel from HEAD (`git archive`: edits not committed are not in it, so PAGEDSERVE_COMMIT
# names the tree measured). The device has torch, triton, transformers and numpy. grpcio
# follows .venv's (the stubs' gencode needs at least the grpcio-tools version that made them),
# protobuf is at least their gencode's. Run from a checkout set up by scripts/setup.sh:
#   bash benchmarks/device_wheels.sh            # deps (once) and pagedserve
#   bash benchmarks/device_wheels.sh --self     # pagedserve only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p .whl
if [ "${1:-}" != --self ]; then
  grpc=$($PY -c "import grpc; print(grpc.__version__)")
  $PY -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d .whl \
    pyzmq==27.3.0 protobuf==7.36.2 "grpcio==$grpc" grpcio-health-checking==1.85.1 \
    grpcio-reflection==1.85.1 gguf==0.19.0 prometheus-client==0.26.0 starlette==1.10.0 \
    uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 anyio==4.16.0 h11==0.16.0 click==8.5.1 idna==3.20 \
    sniffio==1.3.1 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3
  for w in .whl/grpcio-[0-9]*.whl; do  # one grpcio: the one just fetched
    [[ $w == *"grpcio-$grpc-"* ]] || rm -f "$w"
  done
fi
rm -f .whl/pagedserve-*.whl
tree=$(mktemp -d)
git archive HEAD | tar x -C "$tree"
(cd "$tree" && "$OLDPWD/$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OLDPWD/.whl" .)
rm -rf "$tree"
echo "made .whl/ from $(git rev-parse --short HEAD): PAGEDSERVE_COMMIT=$(git rev-parse --short HEAD)"
