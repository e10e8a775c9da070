"""CPU throughput: N concurrent requests through the real gRPC service vs HF `generate`.

Random prompt token ids (fixed seed), greedy, EOS ignored so every request makes exactly
--output tokens. pagedserve: all requests sent at once through gRPC to `pagedserve serve`;
wall time from the first send to the last token. HF: one static batch of the same prompts.

    python -m benchmarks.cpu_throughput --requests 16 --prompt 128 --output 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.common import write_records


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def run_pagedserve(batch: list[list[int]], output: int, flags: list[str]) -> float:
    from tests.integration.service import Service

    svc = Service(Path(tempfile.mkdtemp()) / "serve.log", *flags)
    try:
        svc.wait_serving()
        svc.client.complete(token_ids=batch[0], max_tokens=4, temperature=0)  # warm-up

        def one(ids):
            _, out, _ = svc.client.complete(token_ids=ids, max_tokens=output, temperature=0,
                                            ignore_eos=True, timeout=3600)
            assert len(out) == output
            return len(out)

        start = time.perf_counter()
        with ThreadPoolExecutor(len(batch)) as pool:
            total = sum(pool.map(one, batch))
        return total / (time.perf_counter() - start)
    finally:
        svc.stop()


def run_hf(batch: list[list[int]], output: int, model_dir: Path) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(batch)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=2)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output, min_new_tokens=output,
                             do_sample=False, pad_token_id=2)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output
    return len(batch) * output / elapsed


def main() -> None:
    from pagedserve.models import resolve_model

    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args()
    model_dir = resolve_model("default")
    batch = prompts(args.requests, args.prompt, 49152)
    flags = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    ours = run_pagedserve(batch, args.output, flags)
    hf = run_hf(batch, args.output, model_dir)
    workload = f"cpu_{args.requests}x{args.prompt}->{args.output}"
    common = {"workload": workload, "model": "smollm2-135m-instruct", "dtype": "float32",
              "device": "cpu"}
    records = [{**common, "engine": "pagedserve", "output_tok_s": ours},
               {**common, "engine": "hf_generate", "batch": args.requests, "output_tok_s": hf}]
    print(f"{workload}: pagedserve {ours:.1f} out tok/s, HF generate (bs={args.requests}) "
          f"{hf:.1f} out tok/s, ratio {ours / hf:.2f}")
    print("wrote", write_records("cpu_throughput", records))


if __name__ == "__main__":
    main()
