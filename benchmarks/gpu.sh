#!/usr/bin/env bash
# GPU benchmarks, one device call: run on the device machine from a copy of the repo root.
#   PAGEDSERVE_COMMIT=<sha> PARTS="env tests big" bash benchmarks/gpu.sh
# Models: random bf16 weights for benchmarks/models/{llama3.2-1b,llama3.1-8b} (1B, 8B) and
# smollm2-135m (135M); "throughput settings": 8192-token steps, 8 tokens per streamed message,
# no HF peer. PARTS picks the parts, which run in the order given:
#   env       GPU, CPU count, package versions, where pagedserve imports from
#   tests     GPU tests of CUDA graphs and of the model against HF (tests/executor_svc), and the
#             executor's start-up progress lines on CUDA (tests/test_cli.py)
#   kernels   every kernel test on the GPU (tests/kernels; KERNEL_TESTS: other test ids)
#   prefillbench  paged prefill attention beside cuDNN SDPA at 1 x 8k, 4 x 4k, 16 x 1k, 1 x 32k,
#             1 x 128k, then the long rows' launch over configs (bench_kernels.py's prefill
#             and prefill_sweep sections); ~3 min
#   fusedops  RMSNorm, rotary, SiLU-and-mul and the rotary pass that writes the KV cache
#             (against the two launches it replaces) at 256 and 16,384 rows; ~1 min
#   hopperprefill  the Hopper paged prefill kernel (kernels/paged_prefill_hopper.py): its GPU
#             tests, then (if they pass) the prefill section (as served, each long-row kernel
#             forced, cuDNN), then 1 x 128k at 2,048-token chunks as served (LONG_PROMPTS); ~4 min
#   hopperfp8 the Hopper prefill kernel's GPU tests (its FP8-cache cases among them), then (if
#             they pass) prefill over an FP8 cache at 1 x 8k, 4 x 4k, 1 x 32k and a 2,048-token
#             chunk at 128k: as served, each long-row kernel forced, bf16 beside (bench_kernels
#             section prefill_fp8); ~3 min
#   fp8kv     the FP8 KV-cache kernel tests on the GPU, then decode attention at batch 64 x 8k
#             (8B shapes) over an FP8 cache beside bf16 (benchmarks/kernels/bench_fp8_kv.py)
#   overhead  host cost per step with a stub model: step_overhead at 16, 64, 256 running
#   w1        W1 on 1B and 8B beside HF generate bs256: output tok/s, roofline fraction
#   w1cb      W1 on 1B, throughput settings + async, beside HF generate bs256 and HF CB
#   big       W1 and W2 on 8B and 1B with the throughput settings
#   bigasync  big with --async-scheduling
#   extras    W1 on 8B, throughput settings, plain / every request with a repetition penalty and
#             top_logprobs=5 / extras / plain; then the sampler alone (sampler_extras.py)
#   structured 64 concurrent JSON-schema requests on 8B against 64 unconstrained (TPOT), then
#             the bitmask's host time per step at 256 running (benchmarks/structured.py)
#   sampler   the sampler's GPU tests (the exponential race kernel), then sampler_extras.py
#             recorded: seeded and unseeded temperature sampling at 256 x 128,256
#   structsplit benchmarks.structured with --api-server-count 2 (recorded), then at 256 running
#             with the engine core under cProfile (not recorded): its functions by own time
#   w1eager   W1 on 1B with --enforce-eager (compare with big: what CUDA graphs buy)
#   w2        W2 on 1B and 8B, default step budget and streaming, no peer
#   profile   torch profile of W1 on 8B (2 prefill steps, 4 graphed decodes): ops tables
#   profile1b the same on 1B, whose decode steps are host-bound
#   profile1bdefaults  profile1b with the default flags (step bounds by device, interval 1)
#   profilesched1b  W1 on 1B at the default flags with the scheduler under cProfile
#             (--profile-dir): its functions by cumulative and own time
#   awq       W2 on 8B in bf16, then W1 and W2 with random AWQ weights, throughput settings
#   awqasync  awq's AWQ runs with --async-scheduling (compare with bigasync)
#   awqlat    8B decode, 128 -> 512 tokens, at LAT_SEQS running (default 1 16), bf16 then AWQ
#   awq32     the same at 32 running (the split-K tiled rows)
#   w3        W3 serving on 8B through gRPC at RATES (default 8 16 24 32 inf), W3_N requests
#             (default 200): TTFT, TPOT, ITL, goodput; per-request CSVs kept as dumps
#   prefix    W3 on 135M with a shared 1,000-token system prompt, prefix caching on and off
#   overload  135M at 46 req/s (sustainable) then 70 (1.5x), 10 % high priority, queue of 64
#   quant     W4A16 GPU tests (QUANT_K: a -k selection) and GEMM bench (QUANT_BENCH: its flags,
#             e.g. "--gluon --rows 32 64"; QUANT_S: time limit): us and speedup vs bf16
#   fp8kvsweep  FP8-cache decode configs (tile, warps, stages) at 64 x 8k and 256 x 2k
#             beside bf16's, each checked against the reference; ~2 min
#   fp8gemm   FP8 kernel tests, then the FP8 GEMM bench (FP8_BENCH: its flags, e.g. "--rows 256";
#             FP8_S: time limit): per-token quantization + row-wise _scaled_mm vs bf16 at 8B shapes
#   fp8serve  W1 and W2 on 8B, throughput settings: bf16, then FP8 weights and FP8 KV cache
#             (--quantization fp8: random weights quantized per channel; --kv-cache-dtype fp8)
#   fp8only   fp8serve's FP8 runs alone (W2 then W1; compare with an fp8serve run's bf16)
#   ab        before/after: W1 on 8B and 1B, throughput settings, an older tree (BASELINE=<dir>,
#             its own harness, commit from BASELINE_COMMIT or <dir>/.commit) and this one
#             alternated for AB_ROUNDS rounds (default 2); REPORT.md pairs them
#   split     the engine core split (issue 30): SPLIT_W (default "W1:M1 W2:M1 W1:M8") at the
#             default flags with --api-server-count 0 (the engine in the scheduler process) and
#             SPLIT_N (default 2), alternated 0 N N 0 per workload; records carry ab=baseline (0)
#             or current, api_server_count; SPLIT_W3=1 adds W3 8B at rate=inf (1,000 requests)
#             and SPLIT_JSON=1 benchmarks.structured at 64 and 256 running, both at 0 then N
#   fallback  W1 on 1B at the default flags natively, then through the transformers fallback
#             (--model-impl transformers: HF's modeling code, eager, the paged attention); ~3 min
#   apiscale  W1 on 1B at the default flags once per --api-server-count in API_COUNTS (default
#             1 2 4): the engine core's CPU a step at 256 running as API processes are added
#   curve     the executor link's CURVE keys against none: W1 on 1B, throughput settings,
#             plain/curve/curve/plain; records carry curve and ab (baseline: no keys)
#   tp        needs 2 GPUs (nvidia-h200-x2): 8B W1 at TP=1 then TP=2 (throughput settings);
#             8B decode TPOT at 1 running request, TP=1 then TP=2; the Llama-3.1-70B config
#             (benchmarks/models/llama3.1-70b, random bf16) at TP=2, W1 and W2; then a torch
#             profile of 8B W1 at TP=2 (the all-reduce's share of a decode step: nccl rows)
#   startmax  start-up at the largest step bounds (issue 19): the GPU test that builds the 1B and
#             8B executors at 1,024 sequences and 32,768 batched tokens, checks the graphs'
#             memory against the profile and runs the largest prefill and graphed decode steps,
#             then a too-small --gpu-memory-utilization for the 8B (one-line refusal); ~4 min
#   startmaxserve  `serve` itself at those bounds, 1B then 8B, 1,024 requests at once
#             (32 -> 16 tokens): it must come up and answer all; ~5 min
#   defaults  W1 and W2 on 8B and 1B with the default flags (step bounds by device: 1,024 and
#             8,192 on the H200; async scheduling on; stream interval 1), no peer; ~8 min
#   defaults1b  W1 (or DEFAULTS_W) on 1B with the default flags (~1 min a workload)
#   interval1b  the same with --stream-interval 8: what the gRPC messages per token cost
#   grpcstream  benchmarks/grpc_stream.py on this host: one streamed message's server cost
#   defaults8b  W1 and W2 on 8B with the default flags (~3 min)
#   defaultsw3  W3 at rate=inf, 1,000 requests, 8B, default flags, then at 0.8 of the request
#             rate it completed (the sustainable rate's 80 %); ~5 min
#   w3share   defaultsw3 once per --long-prefill-decode-share in W3_SHARES (default 0 0.3): what
#             the decoders' share costs W3's throughput and TTFT (~5 min each: one a call)
#   families  the model families' GPU tests: every family's bf16 logits against HF, graphed MoE
#             decode (FAMILY_KERNELS: kernel test files to add, e.g. tests/kernels)
#   moekernel the fused-MoE kernel at decode and prefill shapes of Qwen3-30B-A3B and Mixtral
#             beside the torch expert loop, with the tiles the installed moe_configs.json gives
#   moetune   the tiles swept per shape and token count for MOE_TUNE_S seconds (default 200),
#             merged into the installed moe_configs.json (later parts of the call use them) and
#             copied to $B: commit it as kernels/moe_configs.json; MOE_TUNE_ARGS: more
#             bench_moe.py flags (e.g. --shapes qwen3_30b_a3b --tokens 1)
#   moeroute  the routing and alignment kernels' tests on the GPU, then Qwen3-30B-A3B
#             single stream with it off and on (MOE_ROUTES: 0 1 0 1)
#   moedecode moe_decode's GPU tests (and the routing's), bench_moe.py --decode (its tiles
#             against the grouped GEMMs at 1-8 tokens, both shapes), then moelatenv; ~6 min
#   attnmerge the split decode attention's GPU tests (decode-only splits and their merge,
#             the Llama and sliding-window model shapes)
#   decodetests  moe_decode's GPU tests (moedecode's decode_gemvs, without its bench)
#   gemv      kernels/gemv.py's GPU tests, then bench_gemv.py (it against cuBLAS at 1, 2, 4
#             rows of Qwen3-30B-A3B's and Llama-3.1-8B's projections, cold weights); ~1 min
#   gemvsweep kernels/gemv.py's tiles at one row on the shapes it serves (bench_gemv.py
#             --sweep: Qwen3-30B-A3B's q/k/v, o_proj, router), cold weights; ~3 min
#   moelatenv Qwen3-30B-A3B single stream once per MOELAT_ENVS entry, each a comma-separated
#             list of VAR=value (default: PAGEDSERVE_MOE_DECODE_TOKENS=0 and =4)
#   moew1     W1 on qwen3-30b-a3b and mixtral-8x7b (MOE_MODELS: MQ30 MMIX; MOSS is
#             gpt-oss-20b, MDSV2 DeepSeek-V2-Lite: latent attention) beside HF generate
#             bs256, serve's default step bounds
#   moew2     W2 on both at the default flags, no peer (HF generate's W2 batch runs 1,024
#             steps: minutes)
#   moelat    Qwen3-30B-A3B single-stream decode, 128 -> 512 tokens, 1 running
#   moelatab  moelat with PAGEDSERVE_MOE_FUSE_SILU over MOE_FUSES (default 0 1 0 1; records
#             carry env), then the fused-MoE kernel tests on the GPU with it on; ~4 min
#   profilemoe  torch profile of W1 on Qwen3-30B-A3B at the default flags
#   profilelatent  the same of DeepSeek-V2-Lite (latent attention, 64 experts)
#   profilemoelat  torch profile of moelat's single stream (4 graphed decode steps)
#   qwen3     W1 on Llama-3.1-8B then Qwen3-8B at the default flags (q/k norm's cost)
#   numerics  bf16 drift from fp32 on the default model's real weights, beside HF's own bf16
#             (benchmarks/numerics.py): its GGUF carried in two halves, .gguf_a/ on a call of
#             its own (GGUF_A=1: only copies it to /tmp) then .gguf_b/ with this part
#             (NUM_FLAGS=--ablate: each kernel's share of the drift), e.g.
#               split -b 58M -d SmolLM2-135M-Instruct.Q4_1.gguf; mv x00 .gguf_a/; mv x01 .gguf_b/
#   spectests the CUDA-graph tests, verification steps replayed a row per token among them
#   spec      speculative decoding (benchmarks/spec_decode.py): TPOT with SPEC_JSON (default
#             n-gram, k=4) against none at 1 and 16 running on input-grounded chat prompts, on
#             the default model's real weights (its GGUF in two halves, as numerics), then on
#             8B random weights
#   spec32    spec's runs in float32 (the 8B at 1 running, 64 tokens): outputs must equal
#   specdraft 8B at 1 running: a 1B draft (k 4, 2), the 8B as its own draft, n-gram; each
#             record with a step's time by part (per_step_ms)
#   speceagle 8B at 1 running with a random EAGLE-3 head of Llama-3.1-8B's shapes (k 4, 2):
#             what a drafted step costs (random heads propose nothing the target keeps)
#   spec32eagle  the 8B in float32 with the random EAGLE-3 head (k 4, 1 running, 64 tokens),
#             graphed then with --enforce-eager (EAGLE_MODES: "graphs eager"): outputs must
#             equal the run without drafts (a difference is located, with the top-2
#             log-probability gap there)
#   specw1    W1 on 8B at the default flags, then with n-gram drafts off past 16 running
#   longctx   long context (benchmarks/long_context.py), 8B random, prefix caching off: TTFT
#             and prefill TFLOP/s of 1 and 4 prompts of 8k, 32k and 128k (LONG_PROMPTS), then
#             64 decoders' TPOT before and while a 128k prompt prefills and a short request's
#             TTFT mid-prefill, at each --long-prefill-token-threshold in LONG_CHUNKS
#   longshare the 64 decoders and one 128k prompt again at each --long-prefill-decode-share
#             in LONG_SHARES (default 0.5), chunk 512; ~2 min each; LONG_FLAGS: more
#             long_context flags (e.g. --server-flag=--torch-profile-steps ...)
#   lora      multi-LoRA (benchmarks/lora.py): the kernels' and the graphed LoRA decode's GPU
#             tests; the kernels beside their layers (bench_lora.py); W1 8B with LORA_N (8)
#             rank-16 adapters over the requests against the base alone; 8B single stream
#             128 -> 512 with one adapter against without
#   loratune  the LoRA kernels alone over launch configs at 256, 8,192 and 16 tokens for
#             LORA_TUNE_S seconds (default 220): the best per config key merged into the installed
#             lora_configs.json (later parts of the call use it) and copied to $B: commit it as
#             kernels/lora_configs.json
#   remeasure the runs the old warm-up flattered: 8B 128 -> 512 at 1 and 16 running (LAT_SEQS;
#             twice as many requests; bf16 and AWQ)
#             and one 130,000-token prompt with prefix caching on (it must not hit), FP8 W1
#   prefix8b  W3 on 8B with a shared 2,000-token system prompt at PREFIX_RATE (default 4) req/s,
#             200 requests, prefix caching on and off, default flags; ~5 min
# Records go to $B/records (PAGEDSERVE_RESULTS), logs, profiles and dumps to $B; all of it comes
# back as $OUT/bundle.tgz (the device returns at most 8 files). Back here:
#   tar xzf bundle.tgz -C /tmp/b && .venv/bin/python -m benchmarks.common add /tmp/b/records/*
#   .venv/bin/python -m benchmarks.report
# .whl/ (carried, git-ignored): Python 3.12 wheels that benchmarks/device_env.sh installs, the
# dependencies the device lacks and pagedserve's own from HEAD; made on a fresh checkout by
# `bash benchmarks/device_wheels.sh` (again with --self after each commit measured).
# SMI_MS: log the GPU's SM and memory clocks, power, temperatures and throttle reasons every
# SMI_MS milliseconds through the call into $B/smi.csv (a part slower than before: was it hot?).
# BASELINE (ab): a copy of an older commit's tree with its generated stubs, whose top-level
# packages run from PYTHONPATH=/tmp/deps:<dir>, e.g. carried as .baseline/ (git-ignored).
set -uo pipefail
if [ -n "${GGUF_A:-}" ]; then mkdir -p /tmp/gguf_a && cp .gguf_a/* /tmp/gguf_a && ls -l /tmp/gguf_a; exit; fi
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-env tests big}
B=/tmp/bundle
mkdir -p $B/records
export PAGEDSERVE_RESULTS=$B/records
TOK=(--tokenizer benchmarks/models/smollm2-135m)
M1=(--model benchmarks/models/llama3.2-1b --load-format random "${TOK[@]}")
M8=(--model benchmarks/models/llama3.1-8b --load-format random "${TOK[@]}")
M135=(--model benchmarks/models/smollm2-135m --load-format random)
M70=(--model benchmarks/models/llama3.1-70b --load-format random "${TOK[@]}")
MQ8=(--model benchmarks/models/qwen3-8b --load-format random "${TOK[@]}")
MQ30=(--model benchmarks/models/qwen3-30b-a3b --load-format random "${TOK[@]}")
MMIX=(--model benchmarks/models/mixtral-8x7b --load-format random "${TOK[@]}")
MOSS=(--model benchmarks/models/gpt-oss-20b --load-format random "${TOK[@]}")
MDSV2=(--model benchmarks/models/deepseek-v2-lite --load-format random "${TOK[@]}")
TP2=(--server-flag=--tensor-parallel-size --server-flag=2)
FAST=(--hf none --max-num-batched-tokens 8192 --server-flag=--stream-interval --server-flag=8)
BOUNDS=(--max-num-seqs 0 --max-num-batched-tokens 0)  # 0: serve's own step bounds (by device)
DEFAULTS=(--hf none "${BOUNDS[@]}")
start=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - start )) s"; }
save() { tar czf "$OUT/bundle.tgz" -C $B .; }
quiet() { grep -v INFO | tail -"$1"; }
passed() { grep -q " passed" "$1" && ! grep -qE " failed| error" "$1"; }  # a pytest log
moelat() {  # Qwen3-30B-A3B single stream, 128 -> 512 tokens; more throughput.py flags
  tp "" MQ30 --hf none --requests 2 --prompt 128 --output 512 --max-num-seqs 1 \
    --max-num-batched-tokens 0 "$@"
}
moelatenv() {  # moelat once per MOELAT_ENVS entry (VAR=value,VAR=value)
  local spec
  for spec in ${MOELAT_ENVS:-PAGEDSERVE_MOE_DECODE_TOKENS=0 PAGEDSERVE_MOE_DECODE_TOKENS=4}; do
    # shellcheck disable=SC2046  # the entry's assignments, one word each
    ( export $(echo "$spec" | tr , ' '); moelat )
    save  # a call cut short keeps the entries that ran
  done
}
tp() {  # workload, model array name, extra benchmarks.throughput flags
  local w=$1; declare -n model=$2; shift 2
  python3 -m benchmarks.throughput --workload "$w" "${model[@]}" "$@" 2>&1 \
    | tee -a $B/throughput.log | quiet 4
}
fast() { local w=$1 m=$2; shift 2; tp "$w" "$m" "${FAST[@]}" "$@"; }
profile() {  # model array name, label, flags (throughput settings when none)
  local m=$1 label=$2; shift 2
  [ $# -eq 0 ] && set -- "${FAST[@]}"
  tp W1 "$m" "$@" --server-flag=--torch-profile-dir --server-flag=/tmp/profile_"$label" \
    --server-flag=--torch-profile-steps --server-flag=5:2,80:4
  mkdir -p $B/profile_"$label" && cp /tmp/profile_"$label"/ops_* $B/profile_"$label"/
  tail -12 /tmp/profile_"$label"/ops_*_80.txt
}
latency() {  # running counts: 8B decode, bf16 then AWQ
  local q seqs
  for q in none awq; do for seqs in "$@"; do
    tp "" M8 --hf none --requests $(( seqs * 2 )) --prompt 128 --output 512 \
      --max-num-seqs "$seqs" --server-flag=--quantization --server-flag=$q
  done; done
}
ab_run() {  # side (baseline or current), round, model directory name
  local side=$1 dir=/tmp/ab/$1_$2_$3
  local args=(--workload W1 --model benchmarks/models/$3 --load-format random "${TOK[@]}"
              "${FAST[@]}")
  mkdir -p "$dir" && touch "$dir/.start"
  echo "-- ab round $2 $3 $side"
  if [ "$side" = baseline ]; then
    (cd "$BASELINE" && PAGEDSERVE_COMMIT=$AB_BASE PAGEDSERVE_RESULTS=$dir \
      PYTHONPATH=/tmp/deps:$BASELINE python3 -m benchmarks.throughput "${args[@]}")
  else
    PAGEDSERVE_RESULTS=$dir python3 -m benchmarks.throughput "${args[@]}"
  fi 2>&1 | tee -a $B/ab.log | quiet 3
  [ "$side" = baseline ] && find "$BASELINE/benchmarks/results" -maxdepth 1 \
    -name "throughput_*.jsonl" -newer "$dir/.start" -exec mv {} "$dir/" \;  # older harnesses
  local files=("$dir"/*.jsonl)
  [ -e "${files[0]}" ] || { echo "ab: no record from $side $3"; return; }
  python3 -m benchmarks.common add --into $B/records --set ab="$side" --set ab_round="$2" \
    --set ab_session="$AB_SESSION" "${files[@]}"
}
curve() {  # W1 1B with and without CURVE keys on the executor link, alternated
  local k=/tmp/linkkeys side extra
  python3 -m pagedserve.cli keys $k/s --name scheduler >/dev/null
  python3 -m pagedserve.cli keys $k/e --name executor >/dev/null
  mkdir -p $k/a && cp $k/e/executor.key $k/a/
  local keyed=(--server-flag=--scheduler-key --server-flag=$k/s/scheduler.key_secret
               --server-flag=--executor-allowed-keys --server-flag=$k/a
               --server-flag=--executor-key --server-flag=$k/e/executor.key_secret
               --server-flag=--scheduler-public-key --server-flag=$k/s/scheduler.key)
  local session; session=$(date -u +%Y-%m-%dT%H%M)-curve
  for side in plain curve curve plain; do
    extra=(); [ $side = curve ] && extra=("${keyed[@]}")
    mkdir -p /tmp/curve_$side
    PAGEDSERVE_RESULTS=/tmp/curve_$side fast W1 M1 "${extra[@]}"
  done
  python3 -m benchmarks.common add --into $B/records --set ab=baseline --set curve=false \
    --set ab_session="$session" /tmp/curve_plain/throughput.jsonl
  python3 -m benchmarks.common add --into $B/records --set ab=current --set curve=true \
    --set ab_session="$session" /tmp/curve_curve/throughput.jsonl
}
split_add() {  # api server count: its records so far into $B/records (a run held is skipped)
  local side=current; [ "$1" = 0 ] && side=baseline
  python3 -m benchmarks.common add --into $B/records --set ab=$side --set api_server_count="$1" \
    --set ab_session="$SPLIT_SESSION" /tmp/split/"$1"/*.jsonl 2>/dev/null
  save  # a call cut short keeps what ran
}
split_run() {  # api server count, then a benchmarks module and its flags
  local n=$1; shift
  mkdir -p /tmp/split/"$n"
  echo "-- split api-server-count $n: $*"
  PAGEDSERVE_RESULTS=/tmp/split/$n python3 -m "$@" --server-flag=--api-server-count \
    --server-flag="$n" 2>&1 | tee -a $B/split.log | quiet 4
  split_add "$n"
}
split() {
  local spec n N=${SPLIT_N:-2} m
  SPLIT_SESSION=$(date -u +%Y-%m-%dT%H%M)-split; rm -rf /tmp/split
  for spec in ${SPLIT_W:-W1:M1 W2:M1 W1:M8}; do
    declare -n m=${spec#*:}
    for n in 0 "$N" "$N" 0; do
      split_run "$n" benchmarks.throughput --workload "${spec%%:*}" "${m[@]}" "${DEFAULTS[@]}"
    done
  done
  if [ -n "${SPLIT_W3:-}" ]; then for n in 0 "$N"; do
    split_run "$n" benchmarks.serve "${M8[@]}" --workload W3 --num-requests 1000 --rate inf
  done; fi
  if [ -n "${SPLIT_JSON:-}" ]; then for n in 0 "$N"; do
    split_run "$n" benchmarks.structured "${M8[@]}" --concurrency 64 --wide 256
  done; fi
}
ab() {
  [ -d "${BASELINE:-}" ] || { echo "ab: set BASELINE=<dir of the older tree>"; return; }
  AB_BASE=${BASELINE_COMMIT:-$(cat "$BASELINE/.commit" 2>/dev/null || echo baseline)}
  AB_SESSION=$(date -u +%Y-%m-%dT%H%M)
  local r m side sides
  for r in $(seq "${AB_ROUNDS:-2}"); do
    sides="baseline current"; (( r % 2 )) || sides="current baseline"  # ABBA: no order bias
    for m in llama3.1-8b llama3.2-1b; do
      for side in $sides; do ab_run "$side" "$r" "$m"; done
    done
  done
}
if [ -n "${SMI_MS:-}" ]; then
  q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory
  for why in clocks_event_reasons.active clocks_throttle_reasons.active; do  # (driver's name)
    nvidia-smi --query-gpu=$why --format=csv >/dev/null 2>&1 && { q=$q,$why; break; }
  done
  nvidia-smi --query-gpu=$q --format=csv -lms "$SMI_MS" > $B/smi.csv &
  smi=$!
fi
for part in $PARTS; do
  stamp "$part"
  [ -n "${SMI_MS:-}" ] && echo "== $part at $(date -u +%H:%M:%S.%N)" >> $B/smi.csv
  case $part in
    env)
      nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
      echo "cpus $(nproc), affinity $(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')"
      python3 -c "import torch, triton, transformers, grpc, zmq, google.protobuf as p, pagedserve
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      transformers.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__,
      'zmq', zmq.__version__, 'pagedserve from', pagedserve.__file__)" ;;
    tests)
      python3 -m pytest -q -rs tests/executor_svc/test_cuda_graphs.py \
        tests/executor_svc/test_model_gpu.py tests/executor_svc/test_step_clock.py \
        "tests/test_cli.py::test_a_cuda_start_reports_profiling_and_graph_capture" \
        2>&1 | tee $B/pytest_gpu.log | tail -15 ;;
    kernels)
      python3 -m pytest -q -rs ${KERNEL_TESTS:-tests/kernels} 2>&1 | tee $B/pytest_kernels.log \
        | tail -8 ;;
    prefillbench) python3 benchmarks/kernels/bench_kernels.py --out $B/records \
      --sections ceilings,prefill,prefill_sweep 2>&1 | tee -a $B/kernels.log | grep -v "^{" ;;
    fusedops) python3 benchmarks/kernels/bench_kernels.py --out $B/records --sections fused_ops \
      2>&1 | tee -a $B/kernels.log | grep -v "^{" ;;
    hopperprefill)
      python3 -m pytest -q -rs tests/kernels/test_paged_prefill_hopper.py 2>&1 \
        | tee $B/pytest_hopper_prefill.log | tail -12
      if passed $B/pytest_hopper_prefill.log; then
        python3 benchmarks/kernels/bench_kernels.py --out $B/records --sections prefill 2>&1 \
          | tee -a $B/kernels.log | grep -v "^{"
        python3 -m benchmarks.long_context "${M8[@]}" \
          $(for n in ${LONG_PROMPTS:-131072}; do echo --prompt $n; done) --requests 1 --decoders 0 \
          --server-flag=--long-prefill-token-threshold --server-flag=2048 \
          2>&1 | tee -a $B/long_context.log | quiet 10
        save
      fi ;;
    hopperfp8)
      python3 -m pytest -q -rs tests/kernels/test_paged_prefill_hopper.py 2>&1 \
        | tee $B/pytest_hopper_fp8.log | tail -12
      if passed $B/pytest_hopper_fp8.log; then
        python3 benchmarks/kernels/bench_kernels.py --out $B/records --sections prefill_fp8 \
          2>&1 | tee -a $B/kernels.log | grep -v "^{"
      fi ;;
    fp8kvsweep) python3 benchmarks/kernels/bench_fp8_kv.py --sweep 2>&1 \
      | tee -a $B/fp8kv.log | grep -v "^wrote" ;;
    fp8kv)
      python3 -m pytest -q -rs -k fp8 tests/kernels/test_kv_cache.py \
        tests/kernels/test_paged_attention.py 2>&1 | tee $B/pytest_fp8kv.log | tail -8
      python3 benchmarks/kernels/bench_fp8_kv.py 2>&1 | tee -a $B/fp8kv.log | tail -4 ;;
    overhead)
      python3 -m benchmarks.step_overhead --running 16 64 256 2>&1 | quiet 5 ;;
    grpcstream) python3 -m benchmarks.grpc_stream 2>&1 | quiet 2 ;;
    w1) for m in M1 M8; do tp W1 $m --hf generate:256; done ;;
    w1cb) fast W1 M1 --hf cb --hf generate:256 --server-flag=--async-scheduling ;;
    big) for m in M8 M1; do fast W1 $m; fast W2 $m; done ;;
    bigasync) for m in M8 M1; do for w in W1 W2; do
      fast $w $m --server-flag=--async-scheduling; done; done ;;
    extras)
      for x in "" --sampling-extras --sampling-extras ""; do fast W1 M8 $x; done
      python3 benchmarks/sampler_extras.py --batch 256 --vocab 128256 --context 640 2>&1 \
        | tee -a $B/sampler_extras.log ;;
    structured) python3 -m benchmarks.structured "${M8[@]}" --concurrency 64 --wide 256 2>&1 \
      | tee -a $B/structured.log | quiet 8 ;;
    sampler) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sampling.py \
      tests/executor_svc/test_sampler.py 2>&1 | tail -4
      python3 benchmarks/sampler_extras.py --batch 256 --vocab 128256 --context 640 --record \
        2>&1 | tee -a $B/sampler_extras.log ;;
    structsplit) python3 -m benchmarks.structured "${M8[@]}" --concurrency 64 --wide 256 \
      --server-flag=--api-server-count --server-flag=2 2>&1 | tee -a $B/structured.log | quiet 8
      PAGEDSERVE_RESULTS=$B/profiled python3 -m benchmarks.structured "${M8[@]}" --concurrency \
        256 --wide 256 --server-flag=--api-server-count --server-flag=2 --server-flag=--profile-dir \
        --server-flag=$B/profile_engine_json 2>&1 | tee -a $B/structured.log | quiet 4
      python3 -c "import pstats; pstats.Stats('$B/profile_engine_json/engine.prof').sort_stats(
        'tottime').print_stats(30)" | tail -45; rm -f $B/profile_engine_json/engine.prof ;;
    w1eager) fast W1 M1 --server-flag=--enforce-eager ;;
    w2) for m in M1 M8; do tp W2 $m --hf none; done ;;
    profile) profile M8 8b ;;
    profile1b) profile M1 1b ;;
    profile1bdefaults) profile M1 1b_defaults "${DEFAULTS[@]}" ;;
    profilesched1b) tp W1 M1 "${DEFAULTS[@]}" --server-flag=--profile-dir \
      --server-flag=$B/profile_scheduler_1b
      rm -f $B/profile_scheduler_1b/scheduler.prof; head -70 $B/profile_scheduler_1b/*.txt ;;
    awq) fast W2 M8; for w in W1 W2; do fast $w M8 --server-flag=--quantization \
      --server-flag=awq; done ;;
    awqasync) for w in W1 W2; do fast $w M8 --server-flag=--quantization --server-flag=awq \
      --server-flag=--async-scheduling; done ;;
    awqlat) latency ${LAT_SEQS:-1 16} ;;
    awq32) latency 32 ;;
    w3)
      python3 -m benchmarks.serve "${M8[@]}" --workload W3 --num-requests "${W3_N:-200}" \
        --dump "$B/dumps/w3_8b_$(date +%H%M)" ${RATES:---rate 8 --rate 16 --rate 24 --rate 32 \
        --rate inf} 2>&1 | tee -a $B/serve.log | quiet 8 ;;
    prefix) for flag in --enable-prefix-caching --no-enable-prefix-caching; do
      python3 -m benchmarks.serve "${M135[@]}" --workload W3-shared-prefix --shared-prefix 1000 \
        --num-requests 400 --rate 8 --server-flag=$flag 2>&1 | tee -a $B/serve.log | quiet 2
    done ;;
    prefix8b) for flag in --enable-prefix-caching --no-enable-prefix-caching; do
      python3 -m benchmarks.serve "${M8[@]}" --workload W3-shared-prefix --shared-prefix 2000 \
        --num-requests 200 --rate "${PREFIX_RATE:-4}" --server-flag=$flag 2>&1 \
        | tee -a $B/serve.log | quiet 2
    done ;;
    overload)
      python3 -m benchmarks.serve "${M135[@]}" --workload overload-priority --num-requests 400 \
        --rate 46 --rate 70 --high-priority-fraction 0.1 --server-flag=--max-waiting-requests \
        --server-flag=64 2>&1 | tee -a $B/serve.log | quiet 8 ;;
    quant)
      python3 -m pytest -q -rs tests/kernels/test_w4a16.py tests/kernels/test_w4a16_gluon.py \
        ${QUANT_K:+-k "$QUANT_K"} 2>&1 | tee $B/pytest_w4a16.log | tail -4
      # shellcheck disable=SC2086  # QUANT_BENCH is a list of flags
      timeout "${QUANT_S:-420}" python3 benchmarks/quant/bench_w4a16.py --out $B/records \
        ${QUANT_BENCH:-} 2>&1 | tee $B/bench_w4a16.log | grep -v " done$" | tail -30 ;;
    fp8gemm)
      python3 -m pytest -q -rs tests/kernels/test_fp8.py 2>&1 | tee $B/pytest_fp8.log | tail -4
      # shellcheck disable=SC2086  # FP8_BENCH is a list of flags
      timeout "${FP8_S:-420}" python3 benchmarks/quant/bench_fp8.py --out $B/records \
        ${FP8_BENCH:-} 2>&1 | tee $B/bench_fp8.log | tail -40 ;;
    fp8only) for w in W2 W1; do fast $w M8 --server-flag=--quantization --server-flag=fp8 \
      --server-flag=--kv-cache-dtype --server-flag=fp8; done ;;
    fp8serve) for w in W1 W2; do fast $w M8; fast $w M8 --server-flag=--quantization \
      --server-flag=fp8 --server-flag=--kv-cache-dtype --server-flag=fp8; done ;;
    ab) ab ;;
    curve) curve ;;
    split) split ;;
    tp)
      fast W1 M8; fast W1 M8 "${TP2[@]}"
      for t in 1 2; do  # TPOT at one running request: 8B decode, 128 -> 512 tokens
        tp "" M8 --hf none --requests 2 --prompt 128 --output 512 --max-num-seqs 1 \
          --server-flag=--tensor-parallel-size --server-flag=$t
      done
      # 70B: 65.8 GiB of weights per card; the KV cache and graphs take what is left
      fast W1 M70 "${TP2[@]}" --server-flag=--max-model-len --server-flag=4096
      fast W2 M70 "${TP2[@]}" --server-flag=--max-model-len --server-flag=4096
      fast W1 M8 "${TP2[@]}" --server-flag=--torch-profile-dir --server-flag=/tmp/profile_tp \
        --server-flag=--torch-profile-steps --server-flag=5:2,80:4
      mkdir -p $B/profile_tp && cp /tmp/profile_tp/ops_* $B/profile_tp/ 2>/dev/null
      grep -iE "nccl|all_reduce|allreduce|all_gather" /tmp/profile_tp/ops_*_80.txt | head -8 ;;
    startmax)
      python3 -m pytest -q -rs tests/executor_svc/test_start_memory_gpu.py 2>&1 \
        | tee $B/pytest_startmax.log | tail -8 ;;
    startmaxserve) for m in M1 M8; do
      tp "" $m --hf none --requests 1024 --prompt 32 --output 16 --max-num-seqs 1024 \
        --max-num-batched-tokens 32768; done ;;
    defaults) for m in M8 M1; do for w in W1 W2; do tp $w $m "${DEFAULTS[@]}"; done; done ;;
    defaults1b) for w in ${DEFAULTS_W:-W1}; do tp $w M1 "${DEFAULTS[@]}"; done ;;
    defaults8b) for w in ${DEFAULTS_W:-W1 W2}; do tp $w M8 "${DEFAULTS[@]}"; done ;;
    interval1b) for w in ${DEFAULTS_W:-W1}; do
      tp $w M1 "${DEFAULTS[@]}" --server-flag=--stream-interval --server-flag=8; done ;;
    defaultsw3)
      python3 -m benchmarks.serve "${M8[@]}" --workload W3 --num-requests 1000 --rate inf \
        --overload 0.8 --dump "$B/dumps/w3_defaults_8b_$(date +%H%M)" 2>&1 \
        | tee -a $B/serve.log | quiet 8 ;;
    fallback) tp W1 M1 "${DEFAULTS[@]}"; save
      tp W1 M1 "${DEFAULTS[@]}" --server-flag=--model-impl --server-flag=transformers ;;
    apiscale) for n in ${API_COUNTS:-1 2 4}; do
        tp W1 M1 "${DEFAULTS[@]}" --server-flag=--api-server-count --server-flag="$n"; save
      done ;;
    w3share) for share in ${W3_SHARES:-0 0.3}; do
        python3 -m benchmarks.serve "${M8[@]}" --workload W3 --num-requests 1000 --rate inf \
          --overload 0.8 --server-flag=--long-prefill-decode-share --server-flag="$share" \
          --dump "$B/dumps/w3_share${share}_8b_$(date +%H%M)" 2>&1 | tee -a $B/serve.log \
          | quiet 8
        save
      done ;;
    families)
      python3 -m pytest -q -rs tests/executor_svc/test_families_gpu.py ${FAMILY_KERNELS:-} \
        2>&1 | tee $B/pytest_families.log | tail -15 ;;
    moekernel)
      python3 benchmarks/kernels/bench_moe.py 2>&1 | tee -a $B/moe.log | tail -40 ;;
    moetune)
      # shellcheck disable=SC2086  # MOE_TUNE_ARGS is a list of flags (--shapes, --tokens)
      python3 benchmarks/kernels/bench_moe.py --tune --budget-s "${MOE_TUNE_S:-200}" \
        ${MOE_TUNE_ARGS:-} 2>&1 \
        | tee -a $B/moe.log | grep -v Error | tail -24
      cp "$(python3 -c 'from pagedserve.kernels import fused_moe; print(fused_moe.CONFIG_FILE)')" \
        $B/ ;;
    numerics)
      cat /tmp/gguf_a/* .gguf_b/* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
      # shellcheck disable=SC2086  # NUM_FLAGS is a list of flags (--ablate)
      python3 -m benchmarks.numerics --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        ${NUM_FLAGS:-} 2>&1 | tee -a $B/numerics.log | quiet 3 ;;
    moew1) for m in ${MOE_MODELS:-MQ30 MMIX}; do tp W1 $m --hf generate:256 "${BOUNDS[@]}"; done ;;
    moew2) for m in ${MOE_MODELS:-MQ30 MMIX}; do tp W2 $m "${DEFAULTS[@]}"; done ;;
    moelat) moelat ;;
    moelatab) for fuse in ${MOE_FUSES:-0 1 0 1}; do  # SiLU in GEMM 1's epilogue, off and on
        PAGEDSERVE_MOE_FUSE_SILU=$fuse moelat
      done
      PAGEDSERVE_MOE_FUSE_SILU=1 python3 -m pytest -q -rs tests/kernels/test_fused_moe.py \
        2>&1 | tee $B/pytest_moe.log | tail -4 ;;
    moeroute)  # routing and alignment in one launch (PAGEDSERVE_MOE_FUSE_ROUTE), off and on
      python3 -m pytest -q -rs tests/kernels/test_fused_moe.py \
        -k "one_launch or routed_moe or align" 2>&1 | tee $B/pytest_moe_route.log | tail -4
      for fuse in ${MOE_ROUTES:-0 1 0 1}; do
        PAGEDSERVE_MOE_FUSE_ROUTE=$fuse moelat
      done ;;
    moedecode)  # the GEMVs of a few tokens (PAGEDSERVE_MOE_DECODE_TOKENS), off and on
      python3 -m pytest -q -rs tests/kernels/test_fused_moe.py \
        -k "decode_gemvs or route or align" 2>&1 | tee $B/pytest_moe_decode.log | tail -4
      # shellcheck disable=SC2086  # MOE_DECODE_ARGS: more bench_moe.py flags (--tokens 1 4)
      python3 benchmarks/kernels/bench_moe.py --decode ${MOE_DECODE_ARGS:-} 2>&1 \
        | tee -a $B/bench_moe.log | quiet 40
      moelatenv ;;
    moelatenv) moelatenv ;;
    gemvsweep) python3 benchmarks/kernels/bench_gemv.py --sweep 2>&1 \
        | tee -a $B/bench_gemv.log | quiet 8 ;;
    gemv) python3 -m pytest -q -rs tests/kernels/test_gemv.py 2>&1 | tee $B/pytest_gemv.log \
        | tail -4
      python3 benchmarks/kernels/bench_gemv.py 2>&1 | tee -a $B/bench_gemv.log | quiet 40 ;;
    decodetests) python3 -m pytest -q -rs tests/kernels/test_fused_moe.py -k "decode_gemvs" \
        2>&1 | tee $B/pytest_decode.log | tail -4 ;;
    attnmerge) python3 -m pytest -q -rs tests/kernels/test_paged_attention.py \
        -k "decode_only_split or cuda_llama or cuda_window" \
        2>&1 | tee $B/pytest_attn_merge.log | tail -4 ;;
    profilemoe) profile MQ30 moe30b "${DEFAULTS[@]}" ;;
    profilelatent) profile MDSV2 dsv2 "${DEFAULTS[@]}" ;;
    profilemoelat) moelat --server-flag=--torch-profile-dir --server-flag=/tmp/profile_moelat \
        --server-flag=--torch-profile-steps --server-flag=80:4
      mkdir -p $B/profile_moelat && cp /tmp/profile_moelat/ops_* $B/profile_moelat/
      cat /tmp/profile_moelat/ops_*_80.txt | cut -c1-200 | head -70 ;;
    qwen3) for m in M8 MQ8; do tp W1 $m "${DEFAULTS[@]}"; done ;;
    lora)  # multi-LoRA: the kernels' GPU tests, W1 8B with LORA_N (8) rank-16 adapters
      # against the base alone, then 8B single stream (128 -> 512) with one adapter and without
      if [ -z "${LORA_QUICK:-}" ]; then  # LORA_QUICK=1: the two serving runs alone
        python3 -m pytest -q -rs tests/kernels/test_lora.py \
          "tests/executor_svc/test_cuda_graphs.py::test_lora_decode_steps_replay_their_graphs_and_keep_the_eager_tokens" \
          2>&1 | tee $B/pytest_lora.log | tail -4
        python3 benchmarks/kernels/bench_lora.py 2>&1 | tee -a $B/lora_kernels.log | tail -56
        save
      fi
      python3 -m benchmarks.lora "${M8[@]}" --workload W1 --adapters "${LORA_N:-8}" --rank 16 \
        2>&1 | tee -a $B/lora.log | quiet 3
      save
      python3 -m benchmarks.lora "${M8[@]}" --requests 2 --prompt 128 --output 512 \
        --adapters 1 --rank 16 --max-num-seqs 1 2>&1 | tee -a $B/lora.log | quiet 3 ;;
    loratune)
      python3 benchmarks/kernels/bench_lora.py --tune --budget-s "${LORA_TUNE_S:-220}" 2>&1 \
        | tee -a $B/lora_tune.log | grep -v "^  \|(of "
      cp "$(python3 -c 'from pagedserve.kernels import lora; print(lora.CONFIG_FILE)')" $B/ ;;
    spectests) python3 -m pytest -q -rs tests/executor_svc/test_cuda_graphs.py 2>&1 \
      | tee $B/pytest_spec.log | tail -8 ;;
    spec)  # the real default model (its GGUF joined from the two halves), then 8B random
      cat /tmp/gguf_a/* .gguf_b/* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
      python3 -m benchmarks.spec_decode --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --spec "${SPEC_JSON:-{\"method\": \"ngram\", \"num_speculative_tokens\": 4\}}" \
        2>&1 | tee -a $B/spec.log | quiet 4
      save
      python3 -m benchmarks.spec_decode "${M8[@]}" --rounds 1 \
        --spec "${SPEC_JSON:-{\"method\": \"ngram\", \"num_speculative_tokens\": 4\}}" \
        2>&1 | tee -a $B/spec.log | quiet 4 ;;
    spec32)  # losslessness on the GPU: float32, where outputs must equal the baseline's
      cat /tmp/gguf_a/* .gguf_b/* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
      python3 -m benchmarks.spec_decode --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --server-flag=--dtype --server-flag=float32 \
        --spec "${SPEC_JSON:-{\"method\": \"ngram\", \"num_speculative_tokens\": 4\}}" \
        2>&1 | tee -a $B/spec.log | quiet 4
      save
      python3 -m benchmarks.spec_decode "${M8[@]}" --rounds 1 --running 1 --max-tokens 64 \
        --server-flag=--dtype --server-flag=float32 \
        --spec "${SPEC_JSON:-{\"method\": \"ngram\", \"num_speculative_tokens\": 4\}}" \
        2>&1 | tee -a $B/spec.log | quiet 4 ;;
    specdraft)  # 8B single stream: a 1B draft (k 4 and 2), the 8B as its own draft (the
      # ceiling: every draft kept), n-gram; each record breaks a step's time down
      D1=benchmarks/models/llama3.2-1b D8=benchmarks/models/llama3.1-8b
      python3 -m benchmarks.spec_decode "${M8[@]}" --rounds 1 --running 1 \
        --spec "{\"method\": \"draft_model\", \"model\": \"$D1\", \"num_speculative_tokens\": 4}" \
        --spec "{\"method\": \"draft_model\", \"model\": \"$D1\", \"num_speculative_tokens\": ${SPEC_K2:-2}}" \
        --spec "{\"method\": \"draft_model\", \"model\": \"$D8\", \"num_speculative_tokens\": 4}" \
        --spec "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}" \
        2>&1 | tee -a $B/spec.log | quiet 12 ;;
    speceagle)  # 8B single stream with an EAGLE-3 head: the cost of its drafting
      E3=benchmarks/models/llama3.1-8b-eagle3
      python3 -m benchmarks.spec_decode "${M8[@]}" --rounds 1 --running 1 \
        --spec "{\"method\": \"eagle3\", \"model\": \"$E3\", \"num_speculative_tokens\": 4}" \
        --spec "{\"method\": \"eagle3\", \"model\": \"$E3\", \"num_speculative_tokens\": 2}" \
        2>&1 | tee -a $B/spec.log | quiet 8 ;;
    spec32eagle)  # losslessness of an EAGLE head on the GPU, graphs on and off
      E3=benchmarks/models/llama3.1-8b-eagle3
      for mode in ${EAGLE_MODES:-graphs eager}; do  # EAGLE_MODES=eager: that run alone
        eager=$([ "$mode" = eager ] && echo --server-flag=--enforce-eager)
        python3 -m benchmarks.spec_decode "${M8[@]}" --rounds 1 --running 1 --max-tokens 64 \
          --logprobs --server-flag=--dtype --server-flag=float32 $eager \
          --spec "{\"method\": \"eagle3\", \"model\": \"$E3\", \"num_speculative_tokens\": 4}" \
          2>&1 | tee -a $B/spec.log | quiet 4
        save
      done ;;
    specw1)  # what speculation off past 16 running costs at 256: W1 8B, default flags
      tp W1 M8 "${DEFAULTS[@]}"
      tp W1 M8 "${DEFAULTS[@]}" --server-flag=--speculative-config "--server-flag={\"method\": \
\"ngram\", \"num_speculative_tokens\": 4, \"num_speculative_tokens_per_batch_size\": \
[[17, 100000, 0]]}" ;;
    longctx)  # every prompt at the first chunk size, the longest alone at the others
      lp=${LONG_PROMPTS:-8192 32768 131072}
      for chunk in ${LONG_CHUNKS:-512 2048}; do
        python3 -m benchmarks.long_context "${M8[@]}" \
          $(for n in $lp; do echo --prompt $n; done) \
          --requests 1 --requests 4 --decoders 64 \
          --server-flag=--long-prefill-token-threshold --server-flag=$chunk \
          2>&1 | tee -a $B/long_context.log | quiet 10
        save; lp=${lp##* }  # a call cut short keeps the chunk sizes that ran
      done ;;
    longshare)  # the decoders' share: the 128k prompt alone (for the short request's time)
      for share in ${LONG_SHARES:-0.5}; do
        python3 -m benchmarks.long_context "${M8[@]}" --prompt 131072 --requests 1 \
          --decoders 64 --server-flag=--long-prefill-decode-share --server-flag=$share \
          ${LONG_FLAGS:-} 2>&1 | tee -a $B/long_context.log | quiet 10
        save
      done ;;
    remeasure)
      latency ${LAT_SEQS:-1 16}
      tp "" M8 --hf none --requests 1 --prompt 130000 --output 1 --max-num-batched-tokens 0 \
        --max-num-seqs 0 --server-flag=--max-model-len --server-flag=131072
      fast W1 M8 --server-flag=--quantization --server-flag=fp8 ;;
    *) echo "unknown part $part" ;;
  esac
  save
done
stamp done
[ -n "${SMI_MS:-}" ] && kill "$smi"
ls -R $B | head -40
