"""The executor's command-line flags. Kept apart from server.py so that building the command
line (`pagedserve --help`, `pagedserve health`) imports neither torch nor triton."""

from __future__ import annotations

import argparse

from pagedserve.core.config import (
    add_insecure_link_arg,
    add_link_timeout_arg,
    add_speculative_arg,
    add_step_args,
)
from pagedserve.core.lora import add_lora_args


def add_args(p: argparse.ArgumentParser) -> None:
    """The executor's flags; defaults come through pagedserve.core.config (env, config file)."""
    p.add_argument("--scheduler-address", default="tcp://127.0.0.1:5557",
                   help="ZeroMQ address the scheduler binds (its --executor-bind)")
    p.add_argument("--executor-key", default="",
                   help="this executor's CURVE key pair, a NAME.key_secret file made by "
                        "`pagedserve keys` (its NAME.key goes in the scheduler's "
                        "--executor-allowed-keys directory)")
    p.add_argument("--scheduler-public-key", default="",
                   help="the scheduler's public key, its NAME.key file (with --executor-key)")
    add_insecure_link_arg(p)
    add_link_timeout_arg(p)
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:1; auto: CUDA when present")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16 or float16; auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="longest prompt + completion (0: the model's; capped by the KV cache)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV-cache budget on the CPU, GiB")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="exact number of KV blocks (overrides the memory budgets; 0: derive)")
    p.add_argument("--swap-space-gib", "--swap-space", dest="swap_space_gib", type=float,
                   default=None,
                   help="host memory for KV blocks of requests preempted by swap, GiB, "
                        "committed at start (0: none; default: 4 on CUDA, none on the CPU, "
                        "whose KV cache is host memory already); --swap-space / swap_space is "
                        "vLLM's name")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU this process may use (CUDA)")
    p.add_argument("--load-format", choices=["auto", "random"], default="auto",
                   help="random: random weights for the model's config (benchmarks)")
    p.add_argument("--model-impl", choices=["auto", "native", "transformers"], default="auto",
                   help="native: pagedserve's own modules (families in docs/models.md); "
                        "transformers: HF transformers' modeling code with the paged attention "
                        "plugged in (any decoder-only model it has, slower); auto: native "
                        "where a module exists")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: triton on CUDA, torch on CPU")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="auto: the model's dtype; fp8: float8 e4m3 with a scale per layer for "
                        "K and for V (the checkpoint's k_scale/v_scale, else 1.0): twice the "
                        "tokens per GiB")
    p.add_argument("--quantization", choices=["auto", "none", "awq", "gptq", "fp8", "mxfp4"],
                   default="auto",
                   help="awq, gptq: 4-bit weights; fp8: FP8 weights and activations (a float "
                        "checkpoint is quantized at load); mxfp4: gpt-oss's MXFP4 experts, "
                        "dequantized at load (transformers fallback); auto: from config.json's "
                        "quantization_config")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many GPUs of this host (cpu: processes, "
                        "gloo); the executor starts one process per extra rank")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="CUDA: run every step eagerly instead of replaying captured CUDA graphs "
                        "for decode steps")
    p.add_argument("--torch-profile-dir", default="",
                   help="record a torch profiler trace of --torch-profile-steps steps here "
                        "(Chrome trace and an op table; empty: off)")
    p.add_argument("--torch-profile-steps", default="40:4",
                   help="START:COUNT[,START:COUNT...]: the steps to profile, counted from the "
                        "first plan")
    add_step_args(p)
    add_speculative_arg(p)
    add_lora_args(p)
