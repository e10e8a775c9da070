"""Multi-LoRA serving against the base model alone, in one call (records `kind: lora` in
benchmarks/results/lora.jsonl): the same workload through `pagedserve serve` twice, the base
with its default flags, then with --enable-lora and N random rank-R adapters (every target
module) spread over the requests in turn; `lora_vs_base` is the ratio of their output tok/s.

    python -m benchmarks.lora --model benchmarks/models/llama3.1-8b --load-format random \
        --tokenizer benchmarks/models/smollm2-135m --workload W1 --adapters 8 --rank 16
    python -m benchmarks.lora ... --requests 2 --prompt 128 --output 512 --adapters 1 \
        --max-num-seqs 1     # single-stream TPOT with one adapter against without
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import model_flags, write_records
from benchmarks.throughput import run_pagedserve, workload
from pagedserve.executor.lora import TARGETS, module_dims

_PLACE = {m: "self_attn" if m[0] in "qkvo" else "mlp" for m in TARGETS}


def random_adapter(out: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT LoRA checkpoint of every target module (bf16, N(0, 0.01)): speed does not
    depend on the values."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m, (fan_in, fan_out) in module_dims(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{_PLACE[m]}.{m}"
            for half, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
                tensors[f"{key}.lora_{half}.weight"] = (
                    torch.randn(shape, generator=g) * 0.01).to(torch.bfloat16)
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(TARGETS)}))
    return out


def main() -> None:
    from pagedserve.core.models import resolve_model
    from pagedserve.executor.config import ModelConfig

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", default="auto", choices=["auto", "random"])
    p.add_argument("--tokenizer", default="")
    p.add_argument("--workload", default="", choices=["", "W1", "W2"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: the server's default")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(model_dir)
    prompts, outputs = workload(args.workload, args.requests, args.prompt, args.output)
    flags = model_flags(args.model, args.load_format, args.tokenizer)
    if args.max_num_seqs:
        flags += ["--max-num-seqs", str(args.max_num_seqs)]
    root = Path(tempfile.mkdtemp())
    names = [f"lora{i}" for i in range(args.adapters)]
    modules = [f"{n}={random_adapter(root / n, cfg, args.rank, i)}" for i, n in enumerate(names)]
    base = run_pagedserve(prompts, outputs, flags)
    lora = run_pagedserve(prompts, outputs, [
        *flags, "--enable-lora", "--lora-modules", *modules, "--max-loras",
        str(args.adapters), "--max-lora-rank", str(args.rank)], adapters=names)
    name = args.workload or f"{len(prompts)}x{args.prompt}->{args.output}"
    common = {"kind": "lora", "workload": name, "model": Path(str(model_dir)).name,
              "weights": args.load_format, "device": base["device"], "dtype": base["dtype"],
              "num_requests": len(prompts), "adapters": args.adapters, "rank": args.rank}
    records = [{**common, "engine": "pagedserve", "lora": False, **base},
               {**common, "engine": "pagedserve", "lora": True, **lora,
                "lora_vs_base": lora["output_tok_s"] / base["output_tok_s"]}]
    print(f"{name} {common['model']} on {base['device']}: base {base['output_tok_s']:.0f} "
          f"out tok/s (TPOT p50 {base['tpot_p50_ms']:.2f} ms), {args.adapters} adapters of "
          f"rank {args.rank} {lora['output_tok_s']:.0f} (TPOT p50 {lora['tpot_p50_ms']:.2f} ms)"
          f": lora_vs_base {records[1]['lora_vs_base']:.2f}", flush=True)
    print("appended to", write_records("lora", records))


if __name__ == "__main__":
    main()
