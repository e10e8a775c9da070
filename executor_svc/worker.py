"""The executor's state: model, KV-cache tensors and runner, sized by a memory budget."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from executor_svc.config import ModelConfig
from executor_svc.loader import build_model
from executor_svc.quantization import resolve_quantization
from executor_svc.runner import ModelRunner
from executor_svc.sampler import Sampler
from executor_svc.swap import SwapSpace
from protos.pagedserve.internal.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)
GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    model: str  # HF directory (resolved)
    load_format: str = "auto"  # "auto": the directory's safetensors; "random": N(0, 0.02) weights
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on CUDA) or a name in _DTYPES
    block_size: int = 16
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    kv_cache_bytes: int = GiB  # CPU budget for the KV cache
    num_kv_blocks: int = 0  # exact block count; overrides both budgets when > 0
    swap_space_bytes: int = 4 * GiB  # host memory for swapped-out KV blocks
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the card this process may use
    gpu_activation_reserve_bytes: int = 2 * GiB  # CUDA: kept free for activations and logits
    attention_backend: str = "auto"  # "auto" (triton on CUDA, torch on CPU), "torch", "triton"
    quantization: str = "auto"  # "auto" (config.json's quantization_config), "none", "awq", "gptq"


def load_ops(backend: str) -> SimpleNamespace:
    from kernels import get_ops

    return get_ops(backend)


class Worker:
    def __init__(self, cfg: ExecutorConfig) -> None:
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
        if dtype_name not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or auto, got {cfg.dtype!r}")
        self.dtype = _DTYPES[dtype_name]
        backend = cfg.attention_backend
        if backend == "auto":
            backend = "triton" if on_cuda else "torch"
        if backend not in ("torch", "triton"):
            raise ValueError(f"attention backend must be auto, torch or triton, got {backend!r}")
        self.backend = backend
        if cfg.load_format not in ("auto", "random"):
            raise ValueError(f"load format must be auto or random, got {cfg.load_format!r}")
        self.model_cfg = ModelConfig.from_pretrained(cfg.model)
        quant = resolve_quantization(cfg.model, cfg.quantization)
        weights = Path(cfg.model) if cfg.load_format == "auto" else None
        max_len = cfg.max_model_len or self.model_cfg.max_position_embeddings
        model = build_model(self.model_cfg, load_ops(backend), self.dtype, self.device,
                            max_len, weights, quant=quant)
        self.num_blocks = self._num_blocks(cfg)
        if self.num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache: lower the model size or raise "
                               "the memory budget")
        self.block_size = cfg.block_size
        self.max_model_len = min(max_len, self.num_blocks * cfg.block_size)
        shape = (self.num_blocks, cfg.block_size, self.model_cfg.num_kv_heads,
                 self.model_cfg.head_dim)
        # uninitialised on purpose: attention never reads a slot before it is written
        kv = [(torch.empty(shape, dtype=self.dtype, device=self.device),
               torch.empty(shape, dtype=self.dtype, device=self.device))
              for _ in range(self.model_cfg.num_layers)]
        per_block = cfg.block_size * self.model_cfg.kv_bytes_per_token(self.dtype.itemsize)
        self.swap = SwapSpace(cfg.swap_space_bytes // per_block, kv)
        self.runner = ModelRunner(model, kv, cfg.block_size, self.device, Sampler(self.device),
                                  self.swap)
        self.capacity = pb.Capacity(
            num_kv_blocks=self.num_blocks, block_size=cfg.block_size,
            max_model_len=self.max_model_len, vocab_size=self.model_cfg.vocab_size,
            dtype=dtype_name, device=str(self.device), attention_backend=backend, model=cfg.model,
            num_swap_blocks=self.swap.num_blocks,
        )
        self._memory_at, self._memory = 0.0, (0, 0)
        log.info("executor ready: %d KV blocks of %d tokens, max_model_len %d, %s on %s (%s)",
                 self.num_blocks, cfg.block_size, self.max_model_len, dtype_name, self.device,
                 backend)

    def warm_up(self) -> None:
        """One small forward pass and sample before the executor says hello, so that the first
        real step pays no lazy initialisation and a broken model fails before it is announced."""
        n = min(8, self.block_size, self.max_model_len)
        req = pb.NewRequest(req_id=0, token_ids=[0] * n, num_computed_tokens=0, block_ids=[0],
                            sampling=pb.Sampling(temperature=0.0, top_p=1.0))
        start = time.perf_counter()
        self.runner.execute(pb.StepPlan(step_id=0, new_requests=[req],
                                        new_num_scheduled_tokens=[n]))
        self.runner.reset()  # block 0's slots hold garbage now; nothing reads them unwritten
        log.info("warm-up forward of %d tokens: %.2f s", n, time.perf_counter() - start)

    def memory(self) -> tuple[int, int]:
        """(used, total) device memory in bytes; on CUDA at most one query per second."""
        now = time.monotonic()
        if now - self._memory_at >= 1.0:
            self._memory_at, self._memory = now, _memory_of(self.device)
        return self._memory

    def _num_blocks(self, cfg: ExecutorConfig) -> int:
        if cfg.num_kv_blocks > 0:
            return cfg.num_kv_blocks
        per_block = cfg.block_size * self.model_cfg.kv_bytes_per_token(self.dtype.itemsize)
        if self.device.type != "cuda":
            return cfg.kv_cache_bytes // per_block
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used - cfg.gpu_activation_reserve_bytes
        return max(0, budget) // per_block


def _memory_of(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free, total
    try:  # Linux: this process's resident set, the host's physical memory
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        page = os.sysconf("SC_PAGE_SIZE")
        return rss_pages * page, os.sysconf("SC_PHYS_PAGES") * page
    except (OSError, ValueError):
        return 0, 0
