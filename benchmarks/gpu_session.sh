#!/usr/bin/env bash
# One device call: GPU tests, then service throughput and step overhead on the H200.
# Run from the repo root on the device machine with .whl and protos carried:
#   PAGEDSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton, transformers, grpc, zmq, google.protobuf as p; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', \
transformers.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
start=$(date +%s)
python3 -m pytest -q -rs tests/kernels tests/executor_svc 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8
echo "pytest took $(( $(date +%s) - start )) s"
for spec in "256 512 128 8192"; do
  set -- $spec
  python3 -m benchmarks.throughput --model benchmarks/models/smollm2-135m --load-format random \
    --requests "$1" --prompt "$2" --output "$3" --max-num-batched-tokens "$4" 2>&1 \
    | tee -a "$OUT/throughput.log" | grep -v INFO | tail -3
done
python3 -m benchmarks.step_overhead --running 16 64 256 2>&1 | grep -v INFO | tail -5
find benchmarks/results -name "*.jsonl" -newer "$OUT/pytest_gpu.log" -exec cp {} "$OUT/" \;
echo "total $(( $(date +%s) - start )) s"
