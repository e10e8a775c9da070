"""Offline throughput through the real service, beside HF transformers and the roofline.

All requests are sent at once through gRPC to `pagedserve serve` (both processes), random
prompt token ids (fixed seed), greedy, EOS ignored so every request makes exactly its output
length; wall time from the first send to the last token. Every engine first gets the same
warm-up: one call at the measured shape with prompts of the same lengths and other ids, so no
measured prompt is in a prefix cache when the clock starts. Peers on the same device and
(random) weights in the same run: HF `generate` in static batches (arrival order, left-padded,
each batch runs to its longest output) and HF `generate_batch` (continuous batching).

Workloads (../shared/BENCHMARKS.md): W1 = 256 x 512 -> 128; W2 = 256 requests, prompt and
output lengths uniform in [100, 1024] (seed 0); or --requests/--prompt/--output.

The roofline: a lower bound on the workload's time from the ceilings measured in this run
(copy bandwidth, bf16 GEMM rate): prefill at the GEMM rate, then each decode step of all the
sequences still running at once, max(bytes of weights + KV read / bandwidth, FLOPs / rate);
with --max-num-seqs below the requests, in waves of that many (in order, as FCFS admits them).
Weights and KV count at the sizes the run loaded them (an FP8 run gets an FP8 bound; the
record's bound_* fields say which), and a throughput above the bound is refused, not recorded.

    python -m benchmarks.throughput --requests 16 --prompt 128 --output 64            # CPU
    python -m benchmarks.throughput --workload W1 --model benchmarks/models/llama3.1-8b \\
        --load-format random --tokenizer benchmarks/models/smollm2-135m --hf generate:256
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import model_flags, step_breakdown, step_split, write_records

PROMPT_VOCAB = 32000  # prompt ids below every tokenizer's size here (random ids either way)


def workload(name: str, requests: int, prompt: int, output: int,
             seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    if name == "W1":
        requests, p_lens, outs = 256, np.full(256, 512), np.full(256, 128)
    elif name == "W2":
        requests = 256
        p_lens = rng.integers(100, 1025, requests)
        outs = rng.integers(100, 1025, requests)
    else:
        p_lens, outs = np.full(requests, prompt), np.full(requests, output)
    prompts = [rng.integers(100, PROMPT_VOCAB, n).tolist() for n in p_lens.tolist()]
    return prompts, outs.tolist()


def warmup_prompts(prompts: list[list[int]], seed: int = 0) -> list[list[int]]:
    """Prompts of the measured lengths with other ids: a warm-up with a measured prompt left
    its blocks in the prefix cache, and the timed run skipped that prompt's prefill (one
    130k-token request read 12.9x its bound)."""
    rng = np.random.default_rng(seed + 1_000_003)
    return [rng.integers(100, PROMPT_VOCAB, len(p)).tolist() for p in prompts]


WARMUP_TOKENS = 4  # output tokens of each warm-up request: a prefill and a few decode steps


# what `--sampling-extras` asks of every request: issue 18's cost check of the sampler extras
EXTRAS = {"repetition_penalty": 1.1, "logprobs": 5}


async def _send_all(address: str, prompts: list[list[int]], outputs: list[int],
                    extras: dict | None = None, adapters: list[str] | None = None,
                    ) -> tuple[list[tuple[float, float]], float]:
    """All requests at once from one asyncio client (threads would contend for the GIL and
    read tokens later than the server sends them); (TTFT, E2EL) each, and the wall time.
    adapters: LoRA adapter names given to the requests in turn."""
    import grpc

    from pagedserve.protos.v1 import generate_pb2 as api
    from pagedserve.protos.v1 import generate_pb2_grpc

    async def one(stub, ids: list[int], n_out: int, adapter: str) -> tuple[float, float]:
        req = api.GenerateRequest(token_ids=api.TokenIds(ids=ids), adapter=adapter,
                                  sampling=api.SamplingParams(max_tokens=n_out, temperature=0.0,
                                                              ignore_eos=True, **(extras or {})))
        sent = time.perf_counter()
        ttft, n = None, 0
        async for chunk in stub.Generate(req, timeout=3600):
            if ttft is None:
                ttft = time.perf_counter() - sent
            n += len(chunk.token_ids)
            assert not extras or len(chunk.logprobs) == len(chunk.token_ids)
        assert n == n_out, (n, n_out)
        return ttft, time.perf_counter() - sent

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        names = adapters or [""]
        lat = await asyncio.gather(*(one(stub, p, o, names[i % len(names)]) for i, (p, o) in
                                     enumerate(zip(prompts, outputs, strict=True))))
        return lat, time.perf_counter() - start


def run_pagedserve(prompts: list[list[int]], outputs: list[int], flags: list[str],
                   extras: dict | None = None, adapters: list[str] | None = None) -> dict:
    from tests.integration.service import Service, scrape

    log_path = Path(tempfile.mkdtemp()) / "serve.log"
    svc = Service(log_path, *flags)
    try:
        svc.wait_serving(timeout=900)
        info = svc.client.model_info()
        # the same warm-up as the peers: one full-size call of unmeasured prompts
        warm = warmup_prompts(prompts)
        asyncio.run(_send_all(svc.address, warm, [WARMUP_TOKENS] * len(warm), extras,
                              adapters))
        before = scrape(svc.metrics_port, info.model)

        lat, wall = asyncio.run(_send_all(svc.address, prompts, outputs, extras, adapters))
        after = scrape(svc.metrics_port, info.model)
    finally:
        svc.stop()
    ttfts = sorted(t for t, _ in lat)
    tpots = sorted((e - t) / max(1, o - 1) for (t, e), o in zip(lat, outputs, strict=True))
    compiles = [line.strip() for line in log_path.read_text(errors="replace").splitlines()
                if "compiled a kernel variant mid-serving" in line]
    for line in compiles:
        print("  server:", line[:400], flush=True)

    return {"output_tok_s": sum(outputs) / wall, "wall_s": wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * ttfts[int(0.99 * (len(ttfts) - 1))],
            "tpot_p50_ms": 1e3 * statistics.median(tpots),
            **step_breakdown(before, after, wall),
            "kv_token_utilization_at_peak":
                after.get("pagedserve_kv_cache_token_utilization_at_peak"),
            "num_kv_blocks": after.get("pagedserve_num_kv_blocks"),
            "jit_compiles_mid_run": len(compiles),
            "kv_capacity_tokens": after.get("pagedserve_kv_cache_capacity_tokens"),
            "weight_gib": after.get("pagedserve_model_weight_bytes", 0) / 2**30,
            "prefix_cache_hit_tokens": after.get("pagedserve_prefix_cache_hits_total", 0)
                - before.get("pagedserve_prefix_cache_hits_total", 0),
            "kv_cache_dtype": next((k.split('cache_dtype="')[1].split('"')[0] for k in after
                                    if 'cache_dtype="' in k), None),
            "device": info.device, "dtype": info.dtype, "attention_backend": info.attention_backend}


def hf_model(model_dir: Path, random_weights: bool, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if random_weights:
        with torch.device(device):  # initialise on the device: an 8B init on a CPU takes minutes
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    return model.eval()


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def run_hf_generate(model, prompts: list[list[int]], outputs: list[int], batch: int,
                    device: str) -> float:
    """Static batches in arrival order, left-padded; min = max new tokens = the batch's longest
    output (the shorter requests' extra tokens are not counted)."""
    def call(chunk: list[list[int]], n: int) -> None:
        width = max(map(len, chunk))
        ids = torch.zeros((len(chunk), width), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + n

    with torch.no_grad():
        call(warmup_prompts(prompts)[:batch], WARMUP_TOKENS)  # the measured batch's shape
        _sync(device)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            call(prompts[i:i + batch], max(outputs[i:i + batch]))
        _sync(device)
    return sum(outputs) / (time.perf_counter() - start)


def run_hf_generate_fitting(model, prompts: list[list[int]], outputs: list[int], batch: int,
                            device: str) -> tuple[float, int]:
    """run_hf_generate at `batch`, or at the largest half of it that fits in memory (HF's
    Mixtral-8x7B experts run out of it at 256 on an H200): (out tok/s, the batch that ran)."""
    while True:
        try:
            return run_hf_generate(model, prompts, outputs, batch, device), batch
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            gc.collect()
            torch.cuda.empty_cache()
            print(f"  hf generate: out of memory, batch {batch} next", flush=True)


def run_hf_continuous(model, prompts: list[list[int]], outputs: list[int],
                      device: str) -> float:
    """transformers' continuous batching (`generate_batch`); one max_new_tokens for all, so
    only for workloads of equal output lengths."""
    from transformers import GenerationConfig

    if len(set(outputs)) != 1:
        raise ValueError("generate_batch takes one max_new_tokens: equal outputs only")
    cfg = GenerationConfig(max_new_tokens=outputs[0], do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    warm = GenerationConfig(max_new_tokens=WARMUP_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    model.generate_batch(warmup_prompts(prompts), generation_config=warm)
    _sync(device)
    start = time.perf_counter()
    res = model.generate_batch(prompts, generation_config=cfg)
    _sync(device)
    elapsed = time.perf_counter() - start
    made = sum(len(r.generated_tokens) for r in res.values())
    return made / elapsed


def ceilings(device: str) -> dict:
    """Copy bandwidth (bytes read + written) and the bf16 GEMM rate, measured now."""
    import triton.testing

    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB, ~17x the L2
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), rep=200)
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    gemm_ms = triton.testing.do_bench(lambda: x @ y, rep=200)
    return {"copy_tbps": 2 * a.numel() / ms / 1e9, "gemm_tflops": 2 * 8192**3 / gemm_ms / 1e9}


@dataclass(frozen=True)
class Params:
    """A model's parameters as the bound counts them: every step reads `dense` (attention,
    dense MLPs, routers and shared experts) and the LM head once, and of each sparse layer's
    experts (`expert` parameters each) those its tokens are routed to."""

    dense: int
    head: int
    expert: int = 0
    num_experts: int = 0
    top_k: int = 0
    sparse_layers: int = 0

    def touched(self, tokens: int) -> float:
        """Experts a layer reads for `tokens` routed uniformly: E(1 - (1 - k/E)^B)."""
        if not self.num_experts:
            return 0.0
        e = self.num_experts
        return e * (1 - (1 - self.top_k / e) ** tokens)

    def read(self, tokens: int) -> float:  # parameters a step of `tokens` tokens reads
        return self.dense + self.head + self.sparse_layers * self.touched(tokens) * self.expert

    def active(self) -> float:  # parameters each token multiplies by
        return self.dense + self.head + self.sparse_layers * self.top_k * self.expert

    def loaded(self, tied: bool) -> float:
        return self.dense + self.head * (1 if tied else 2) \
            + self.sparse_layers * self.num_experts * self.expert


def weight_params(cfg) -> Params:
    """The parameters of the decoder layers and of the LM head, which every step reads once
    (the embedding lookup reads a row a token: not counted)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    lat = getattr(cfg, "latent", None)
    if lat is not None:  # q (through its low rank or not), kv_a, kv_b (W_UK, W_UV), o
        heads, qk = cfg.num_heads, lat.nope + lat.rope
        q = (h * lat.q_lora_rank + lat.q_lora_rank * heads * qk if lat.q_lora_rank
             else h * heads * qk)
        attn = q + h * (lat.kv_lora_rank + lat.rope) \
            + lat.kv_lora_rank * heads * (lat.nope + lat.v) + heads * lat.v * h
    head = cfg.vocab_size * cfg.hidden_size
    moe = cfg.moe
    if moe is None:
        return Params(cfg.num_layers * (attn + 3 * h * cfg.intermediate_size), head)
    sparse = sum(moe.sparse_layers)
    dense = cfg.num_layers * attn + (cfg.num_layers - sparse) * 3 * h * cfg.intermediate_size \
        + sparse * (h * moe.num_experts + 3 * h * moe.shared_intermediate_size)
    return Params(dense, head, 3 * h * moe.intermediate_size, moe.num_experts, moe.top_k,
                  sparse)


def bound_basis(cfg, weight_bytes: float, kv_cache_dtype: str | None) -> dict:
    """The bytes the bound reads: each weight at the size the run loaded it (from the
    executor's weight bytes, so an FP8 run is held to an FP8 bound, not a bf16 one) and each
    KV element at the cache's size; for experts, the ones a step's tokens touch."""
    params = weight_params(cfg)
    loaded = params.loaded(cfg.tie_word_embeddings)
    per_weight = weight_bytes / loaded if weight_bytes else 2.0
    kv = 1 if kv_cache_dtype and kv_cache_dtype.startswith("fp8") else 2
    model = "dense" if not params.num_experts else \
        "moe: weights of the experts touched under uniform routing, E(1-(1-k/E)^B) a layer; " \
        "FLOPs of the active parameters"
    return {"bound_weight_bytes_per_param": round(per_weight, 3), "bound_kv_bytes": kv,
            "bound_model": model}


def roofline_seconds(cfg, prompt_lens: list[int], outputs: list[int], tbps: float,
                     tflops: float, weight_bytes_per_param: float = 2.0,
                     kv_bytes: int = 2, max_running: int = 0, sequential: bool = False) -> float:
    """Lower bound on the workload's time on a device with these ceilings (module doc); at
    most max_running sequences at once (0: all of them). `sequential`: each decode step's
    attention (its KV read or FLOPs) and its GEMMs (their weight read or FLOPs) one after the
    other, as a layer's data dependencies order them (the recorded bound takes the larger of
    the step's bytes and FLOPs as if they overlapped): what no layer-by-layer engine beats."""
    if 0 < max_running < len(prompt_lens):
        return sum(roofline_seconds(cfg, prompt_lens[i:i + max_running],
                                    outputs[i:i + max_running], tbps, tflops,
                                    weight_bytes_per_param, kv_bytes, sequential=sequential)
                   for i in range(0, len(prompt_lens), max_running))
    layers, d = cfg.num_layers, cfg.head_dim
    params = weight_params(cfg)
    kv_tok = cfg.kv_bytes_per_token(kv_bytes)
    attn = 4 * layers * cfg.num_heads * d  # FLOPs per (query, key) pair: QK^T and PV
    lat = getattr(cfg, "latent", None)
    if lat is not None:  # per head, keys of nope + rope and values of v (expanded: the fewer)
        attn = 2 * layers * cfg.num_heads * (lat.nope + lat.rope + lat.v)
    bw, rate = tbps * 1e12, tflops * 1e12
    p = np.asarray(prompt_lens, np.float64)
    o = np.asarray(outputs)
    body = params.active() - params.head
    prefill = 2 * body * p.sum() + 2 * params.head * len(p) + attn * (p * (p + 1) / 2).sum()
    t = prefill / rate
    for i in range(1, int(o.max())):  # the first token of each comes from its prefill
        live = o > i
        ctx = p[live] + i
        n = int(live.sum())
        weights, kv = weight_bytes_per_param * params.read(n), kv_tok * ctx.sum()
        gemm_flops, attn_flops = 2 * params.active() * n, attn * ctx.sum()
        if sequential:
            t += max(kv / bw, attn_flops / rate) + max(weights / bw, gemm_flops / rate)
        else:
            t += max((weights + kv) / bw, (gemm_flops + attn_flops) / rate)
    return t


def tensor_parallel_size(server_flags: list[str]) -> int:
    """The ranks that serve runs with, from the forwarded flags (--flag VALUE or --flag=VALUE)."""
    for i, flag in enumerate(server_flags):
        if flag.startswith("--tensor-parallel-size="):
            return int(flag.split("=", 1)[1])
        if flag == "--tensor-parallel-size" and i + 1 < len(server_flags):
            return int(server_flags[i + 1])
    return 1


def main() -> None:
    from pagedserve.core.models import resolve_model
    from pagedserve.executor.config import ModelConfig

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", default="auto", choices=["auto", "random"])
    p.add_argument("--tokenizer", default="", help="tokenizer directory (config-only models)")
    p.add_argument("--workload", default="", choices=["", "W1", "W2"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra flag for pagedserve serve (repeatable)")
    p.add_argument("--hf", action="append", default=None,
                   help="peers: generate:BATCH or cb (repeatable; default generate:<all>; "
                        "none: no peer)")
    p.add_argument("--sampling-extras", action="store_true",
                   help=f"every request also asks for {EXTRAS} (greedy stays greedy)")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(model_dir)
    prompts, outputs = workload(args.workload, args.requests, args.prompt, args.output)
    flags = [*model_flags(args.model, args.load_format, args.tokenizer),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-num-seqs", str(args.max_num_seqs), *args.server_flag]
    extras = EXTRAS if args.sampling_extras else None
    ours = run_pagedserve(prompts, outputs, flags, extras)
    name = args.workload or f"{len(prompts)}x{args.prompt}->{args.output}"
    common = {"workload": name, "model": Path(str(model_dir)).name,
              "weights": args.load_format, "device": ours["device"], "dtype": ours["dtype"],
              "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "output_tokens": sum(outputs)}
    on_gpu = ours["device"] != "cpu"
    tp = tensor_parallel_size(args.server_flag)
    if tp > 1:
        common["tensor_parallel_size"] = tp
    if on_gpu:  # N ranks: N cards' bandwidth and GEMM rate (the all-reduces are not in it)
        ceil = ceilings("cuda")
        basis = bound_basis(cfg, tp * ours["weight_gib"] * 2**30, ours["kv_cache_dtype"])
        bound = sum(outputs) / roofline_seconds(
            cfg, list(map(len, prompts)), outputs, tp * ceil["copy_tbps"],
            tp * ceil["gemm_tflops"], basis["bound_weight_bytes_per_param"],
            basis["bound_kv_bytes"], args.max_num_seqs)
        common.update(ceil, **basis, bound_output_tok_s=bound)
    records = [{**common, "engine": "pagedserve", "server_flags": " ".join(args.server_flag),
                **({"sampling": extras} if extras else {}), **ours}]
    line = f"{name} {common['model']} on {ours['device']}: pagedserve" \
           f"{' with ' + str(extras) if extras else ''} " \
           f"{ours['output_tok_s']:.0f} out tok/s"
    if on_gpu:
        line += f" ({ours['output_tok_s'] / bound:.2f} of the bound {bound:.0f})"
    peers = args.hf if args.hf is not None else [f"generate:{len(prompts)}"]
    peers = [peer for peer in peers if peer != "none"]  # none: no peer (ignored beside others)
    if peers:
        dtype = torch.float32 if ours["dtype"] == "float32" else torch.bfloat16
        device = "cuda" if on_gpu else "cpu"
        model = hf_model(model_dir, args.load_format == "random", device, dtype)
        for peer in peers:
            if peer == "cb":
                tok_s, rec = run_hf_continuous(model, prompts, outputs, device), {
                    "engine": "hf_continuous_batching"}
            else:
                asked = int(peer.split(":")[1])
                tok_s, bs = run_hf_generate_fitting(model, prompts, outputs, asked, device)
                rec = {"engine": "hf_generate", "batch": bs,
                       **({"batch_asked": asked} if bs != asked else {})}
            records.append({**common, **rec, "output_tok_s": tok_s})
            line += f"; {rec['engine']}{'' if peer == 'cb' else ' bs' + str(bs)} {tok_s:.0f}"
    for r in records:
        if on_gpu:
            r["roofline_fraction"] = r["output_tok_s"] / bound
    print(line, flush=True)
    print("  per step: {step_ms:.1f} ms = plan {plan_ms:.2f} + round trip {round_trip_ms:.2f} "
          "(executor {execute_ms:.2f}) + the rest; {graph_steps:.0f} graphed, {eager_steps:.0f} "
          "eager steps; KV token utilization at peak {kv_token_utilization_at_peak}; weights "
          "{weight_gib:.2f} GiB, KV cache {kv_capacity_tokens:.0f} tokens".format(**ours),
          flush=True)
    print("  " + step_split(ours), flush=True)
    print("appended to", write_records("throughput", records))


if __name__ == "__main__":
    main()
