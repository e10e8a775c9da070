"""Throughput: N concurrent requests through the real gRPC service vs HF `generate`.

Random prompt token ids (fixed seed), greedy, EOS ignored so every request makes exactly
--output tokens. pagedserve: `pagedserve serve` started with the given flags, all requests sent
at once through gRPC; wall time from the first send to the last token; TTFT per request. HF: one
static batch of the same prompts on the same device and weights (random weights when
--load-format random).

    python -m benchmarks.throughput --requests 16 --prompt 128 --output 64            # CPU
    python -m benchmarks.throughput --model benchmarks/models/smollm2-135m \\
        --load-format random --requests 256 --prompt 512 --output 128               # GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.common import write_records


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def run_pagedserve(batch: list[list[int]], output: int, flags: list[str]) -> dict:
    from tests.integration.service import Service

    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", *flags)
    try:
        svc.wait_serving(timeout=600)
        info = svc.client.model_info()
        svc.client.complete(token_ids=batch[0], max_tokens=4, temperature=0)  # warm-up

        def one(ids):
            sent = time.perf_counter()
            ttft, n = None, 0
            for chunk in svc.client.generate(token_ids=ids, max_tokens=output, temperature=0,
                                             ignore_eos=True, timeout=3600):
                if ttft is None:
                    ttft = time.perf_counter() - sent
                n += len(chunk.token_ids)
            assert n == output
            return ttft, time.perf_counter() - sent

        start = time.perf_counter()
        with ThreadPoolExecutor(len(batch)) as pool:
            lat = list(pool.map(one, batch))
        wall = time.perf_counter() - start
    finally:
        svc.stop()
    ttfts = sorted(t for t, _ in lat)
    tpots = sorted((e - t) / (output - 1) for t, e in lat)
    return {"output_tok_s": len(batch) * output / wall, "wall_s": wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * ttfts[int(0.99 * (len(ttfts) - 1))],
            "tpot_p50_ms": 1e3 * statistics.median(tpots),
            "device": info.device, "dtype": info.dtype, "attention_backend": info.attention_backend}


def run_hf(batch: list[list[int]], output: int, model_dir: Path, random_weights: bool,
           device: str, dtype: torch.dtype) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                 dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model = model.to(device).eval()
    ids = torch.tensor(batch, device=device)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output,
                             min_new_tokens=output, do_sample=False, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output
    return len(batch) * output / elapsed


def main() -> None:
    from pagedserve.models import resolve_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", default="auto", choices=["auto", "random"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-hf", action="store_true")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = prompts(args.requests, args.prompt, vocab)
    flags = ["--model", args.model, "--load-format", args.load_format,
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-num-seqs", str(args.max_num_seqs)]
    ours = run_pagedserve(batch, args.output, flags)
    workload = f"{args.requests}x{args.prompt}->{args.output}"
    common = {"workload": workload, "model": Path(str(model_dir)).name,
              "weights": args.load_format, "device": ours["device"], "dtype": ours["dtype"]}
    records = [{**common, "engine": "pagedserve", **ours}]
    line = f"{workload} on {ours['device']}: pagedserve {ours['output_tok_s']:.1f} out tok/s"
    if not args.no_hf:
        dtype = torch.float32 if ours["dtype"] == "float32" else torch.bfloat16
        device = "cpu" if ours["device"] == "cpu" else "cuda"
        hf = run_hf(batch, args.output, model_dir, args.load_format == "random", device, dtype)
        records.append({**common, "engine": "hf_generate", "batch": args.requests,
                        "output_tok_s": hf})
        ratio = ours["output_tok_s"] / hf
        line += f", HF generate (bs={args.requests}) {hf:.1f}, ratio {ratio:.2f}"
    print(line)
    print("wrote", write_records("throughput", records))


if __name__ == "__main__":
    main()
