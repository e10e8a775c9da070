#!/usr/bin/env bash
# One device call for issue 5's measurements (H200, SmolLM2-135M shape, random bf16 weights):
# W3 with a shared 1,000-token system prompt, prefix caching on vs off; and overload at 1.5x
# capacity (46 req/s was sustainable, 70 is 1.5x) with 10 % high-priority requests and a
# bounded queue.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
M=(--model benchmarks/models/smollm2-135m --load-format random)
touch "$OUT/.start"
for caching in on off; do
  flag=--enable-prefix-caching; [ $caching = off ] && flag=--no-enable-prefix-caching
  python3 -m benchmarks.serve "${M[@]}" --workload W3-shared-prefix --shared-prefix 1000 \
    --num-requests 400 --rate 8 --server-flag=$flag 2>&1 | grep -v INFO | tail -2
done
python3 -m benchmarks.serve "${M[@]}" --workload overload-priority --num-requests 400 \
  --rate 46 --rate 70 --high-priority-fraction 0.1 --server-flag=--max-waiting-requests \
  --server-flag=64 2>&1 | grep -v INFO | tail -6
find benchmarks/results -name "serve_*.jsonl" -newer "$OUT/.start" -exec cp {} "$OUT/" \;
