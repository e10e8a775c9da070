#!/usr/bin/env bash
# One device call for issue 4 (and issue 5's overload run): GPU tests of the CUDA graphs and
# the memory profile, then W1/W2 offline throughput on random-weight Llama-3.2-1B and
# Llama-3.1-8B (bf16) beside HF transformers, then W3 serving on 8B.
#   PAGEDSERVE_COMMIT=<sha> PARTS="tests w1 overload" bash benchmarks/gpu_session_speed.sh
# Parts: cpu, tests, w1 (W1 with HF generate bs256), big (W1+W2, throughput settings), w1big,
# w1async, profile (torch profiles, W1 8B), w1si8, w1eager, w1cb (HF continuous batching), w2,
# w3 (8B rates), overload (135M: 46 req/s, sustainable, then 70 = 1.5x), profile1b (torch
# profiles of W1 1B), quant (W4A16 GPU tests and GEMM bench), quantpacked (its sweep of
# the packed-pair dequantization, QROWS rows), quantplanes (the plane-major tiled kernel's
# tests and sweep), quantgluon (the Gluon kernel's tests and sweep), awq
# (W1 and W2 on 8B with random AWQ weights, and W2 bf16 beside them), awqlat (8B decode at
# 1 and 16 running requests, bf16 and AWQ), awq32 (the same at 32 running), bigasync (big with
# --async-scheduling), awqasync (awq's AWQ runs with --async-scheduling), kernels (every kernel
# test on the GPU). W3_N and RATES override the w3 part's request count and rates.
# Everything new comes back in one archive, $OUT/bundle.tgz (the device returns at most 8 files).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-tests w1}
TOK=(--tokenizer benchmarks/models/smollm2-135m)
M1=(--model benchmarks/models/llama3.2-1b --load-format random "${TOK[@]}")
M8=(--model benchmarks/models/llama3.1-8b --load-format random "${TOK[@]}")
touch "$OUT/.start"
B=/tmp/bundle; mkdir -p $B
start=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - start )) s"; }
save() { find benchmarks/results -name "*.jsonl" -newer "$OUT/.start" -exec cp {} $B/ \; ;
  [ -d benchmarks/results/dumps ] && cp -r benchmarks/results/dumps $B/;
  tar czf "$OUT/bundle.tgz" -C $B .; }
tp() {  # workload, model array name, extra benchmarks.throughput flags
  local w=$1; declare -n model=$2; shift 2
  python3 -m benchmarks.throughput --workload "$w" "${model[@]}" "$@" 2>&1 | grep -v INFO \
    | tail -4
}
throughput() {  # as tp, with the throughput settings and no HF peer
  local w=$1 m=$2; shift 2
  tp "$w" "$m" --hf none --max-num-batched-tokens 8192 --server-flag=--stream-interval \
    --server-flag=8 "$@"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for part in $PARTS; do
  stamp "$part"
  case $part in
    tests)
      python3 -m pytest -q -rs tests/executor_svc/test_cuda_graphs.py \
        tests/executor_svc/test_model_gpu.py 2>&1 | tee $B/pytest_gpu.log | tail -15 ;;
    w1) for m in M1 M8; do tp W1 $m --hf generate:256; done ;;
    cpu)
      nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null
      python3 -c "import os; print('affinity', len(os.sched_getaffinity(0)))" ;;
    big)  # throughput settings: 8 tokens per streamed message, 8192-token steps
      for m in M8 M1; do throughput W1 $m; throughput W2 $m; done ;;
    w1big) for m in M8 M1; do throughput W1 $m; done ;;
    bigasync)  # big, with --async-scheduling
      for m in M8 M1; do for w in W1 W2; do
        throughput $w $m --server-flag=--async-scheduling; done; done ;;
    kernels)
      python3 -m pytest -q -rs tests/kernels 2>&1 | tee $B/pytest_kernels.log | tail -4 ;;
    w1async) for m in M8 M1; do throughput W1 $m --server-flag=--async-scheduling; done ;;
    profile)  # torch profiles of W1 8B: two prefill steps, then four graphed decodes
      throughput W1 M8 --server-flag=--torch-profile-dir --server-flag=/tmp/profile_8b \
        --server-flag=--torch-profile-steps --server-flag=5:2,80:4
      mkdir -p $B/profile_8b && cp /tmp/profile_8b/ops_* $B/profile_8b/ ;;
    profile1b)  # the same on 1B, whose decode steps are host-bound
      throughput W1 M1 --server-flag=--torch-profile-dir --server-flag=/tmp/profile_1b \
        --server-flag=--torch-profile-steps --server-flag=5:2,80:4
      mkdir -p $B/profile_1b && cp /tmp/profile_1b/ops_* $B/profile_1b/
      tail -12 /tmp/profile_1b/ops_*_80.txt ;;
    quant)  # QUANT_K: a pytest -k selection of the W4A16 tests (Triton and Gluon)
      python3 -m pytest -q -rs tests/kernels/test_w4a16.py tests/kernels/test_w4a16_gluon.py \
        ${QUANT_K:+-k "$QUANT_K"} 2>&1 \
        | tee $B/pytest_w4a16.log \
        | tail -4
      timeout ${QUANT_S:-300} python3 benchmarks/quant/bench_w4a16.py --out $B 2>&1 \
        | tee $B/bench_w4a16.log | grep -v " done$" | tail -30 ;;
    quantpacked)  # issue 7: the packed-pair (inline PTX) dequantization, GPU tests and a sweep
      python3 -m pytest -q -rs tests/kernels/test_w4a16.py 2>&1 | tee $B/pytest_w4a16.log \
        | tail -4
      timeout ${QUANT_S:-420} python3 benchmarks/quant/bench_w4a16.py --out $B --packed \
        --rows ${QROWS:-1 4 16 64 256} 2>&1 | tee $B/bench_w4a16_packed.log \
        | grep -v " done$" | tail -30 ;;
    quantplanes)  # issue 7: the plane-major tiled kernel, its GPU tests and a sweep
      python3 -m pytest -q -rs tests/kernels/test_w4a16.py ${QUANT_K:+-k "$QUANT_K"} 2>&1 \
        | tee $B/pytest_w4a16.log | tail -4
      timeout ${QUANT_S:-420} python3 benchmarks/quant/bench_w4a16.py --out $B --planes \
        --rows ${QROWS:-32 64 128 256} 2>&1 | tee $B/bench_w4a16_planes.log \
        | grep -v " done$" | tail -30 ;;
    quantgluon)  # issue 7: the Gluon kernel, its GPU tests and a sweep
      python3 -m pytest -q -rs tests/kernels/test_w4a16_gluon.py 2>&1 \
        | tee $B/pytest_w4a16_gluon.log | tail -15
      timeout ${QUANT_S:-420} python3 benchmarks/quant/bench_w4a16.py --out $B --gluon \
        --rows ${QROWS:-32 64 128 256} 2>&1 | tee $B/bench_w4a16_gluon.log \
        | grep -v " done$" | tail -30 ;;
    awq)
      throughput W2 M8
      for w in W1 W2; do throughput $w M8 --server-flag=--quantization --server-flag=awq; done ;;
    awqlat)  # 8B decode at 1 and 16 running requests, bf16 then AWQ: where the GEMV rows matter
      for q in none awq; do for seqs in 1 16; do
        tp "" M8 --hf none --requests $(( seqs * 2 )) --prompt 128 --output 512 \
          --max-num-seqs $seqs --server-flag=--quantization --server-flag=$q
      done; done ;;
    awq32)  # 8B decode at 32 running, bf16 then AWQ (the split-K tiled rows); AWQ_Q: which
      for q in ${AWQ_Q:-none awq}; do
        tp "" M8 --hf none --requests 64 --prompt 128 --output 512 --max-num-seqs 32 \
          --server-flag=--quantization --server-flag=$q
      done ;;
    awqasync)  # AWQ with --async-scheduling (compare with bigasync)
      for w in W1 W2; do throughput $w M8 --server-flag=--quantization --server-flag=awq \
        --server-flag=--async-scheduling; done ;;
    w1si8) tp W1 M1 --hf none --server-flag=--stream-interval --server-flag=8 ;;
    w1eager) throughput W1 M1 --server-flag=--enforce-eager ;;  # compare: w1big's 1B
    w1cb)  # HF continuous batching and generate bs256 beside pagedserve's settings, one run
      throughput W1 M1 --hf cb --hf generate:256 --server-flag=--async-scheduling ;;
    w2) for m in M1 M8; do tp W2 $m --hf none; done ;;
    w3)
      python3 -m benchmarks.serve "${M8[@]}" --workload W3 --num-requests ${W3_N:-200} \
        --dump "benchmarks/results/dumps/w3_8b_$(date +%H%M)" \
        ${RATES:---rate 8 --rate 16 --rate 24 --rate 32 --rate inf} \
        2>&1 | grep -v INFO | tail -8 ;;
    overload)
      python3 -m benchmarks.serve --model benchmarks/models/smollm2-135m --load-format random \
        --workload overload-priority --num-requests 400 --rate 46 --rate 70 \
        --high-priority-fraction 0.1 --server-flag=--max-waiting-requests \
        --server-flag=64 2>&1 | grep -v INFO | tail -8 ;;
  esac
  save
done
stamp done
cp $B/*.log "$OUT/" 2>/dev/null; ls -R $B | head -40
