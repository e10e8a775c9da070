"""The executor's state: model, KV-cache tensors and runner, sized by a memory budget."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from pagedserve.core.config import step_bounds
from pagedserve.core.lora import LoraConfig, lora_config
from pagedserve.core.progress import phase
from pagedserve.executor import layers
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.draft import DraftModel, DraftModelError
from pagedserve.executor.eagle import EagleDraft, EagleHead, HeadGraphs, load_head
from pagedserve.executor.families import UnsupportedModelError
from pagedserve.executor.loader import build_model
from pagedserve.executor.lora import LoraRuntime
from pagedserve.executor.lora import build as build_lora
from pagedserve.executor.lora import warm_up as warm_up_lora
from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.executor.penalties import TokenCounts
from pagedserve.executor.quantization import resolve_quantization
from pagedserve.executor.runner import ModelRunner
from pagedserve.executor.sampler import MAX_TOP_LOGPROBS, Sampler, SamplingBatch, SamplingSpec
from pagedserve.executor.swap import SwapSpace, distinct_caches
from pagedserve.protos.internal.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)
GiB = 1 << 30
DEFAULT_SWAP_SPACE_BYTES = 4 * GiB  # --swap-space-gib on CUDA when not set (vLLM's default)
# CUDA: what the profile cannot see: cuBLAS workspaces of the capture stream, the graphs'
# own allocations, pinned staging buffers (on the H200, a profile of allocated rather than
# reserved memory left a test process 40 MiB over its limit)
MARGIN = 512 << 20
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
    lora: LoraConfig | None = None  # --enable-lora: adapters, slots, rank
    swap_space_bytes: int | None = None  # host memory for swapped-out KV blocks (None: by
    # device, DEFAULT_SWAP_SPACE_BYTES on CUDA, none on the CPU)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the card this process may use
    max_num_batched_tokens: int = 2048  # the largest step, profiled at start (0: by device)
    max_num_seqs: int = 128  # most sequences in a step; decode graphs up to it (0: by device)
    enforce_eager: bool = False  # CUDA: no graphs, every step launches its kernels eagerly
    attention_backend: str = "auto"  # "auto" (triton on CUDA, torch on CPU), "torch", "triton"
    quantization: str = "auto"  # "auto" (config.json's), "none", "awq", "gptq", "fp8", "mxfp4"
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (e4m3, scales per layer)
    tensor_parallel_size: int = 1  # ranks of the group (executor_svc/distributed.py)
    tensor_parallel_rank: int = 0  # this process's rank: its share of the model and KV cache
    model_impl: str = "auto"  # "auto", "native", "transformers" (ModelConfig.from_pretrained)
    draft_model: str = ""  # speculative decoding's draft (resolved directory; "": none)
    draft_method: str = "draft_model"  # what draft_model is: a model, or an "eagle"/"eagle3" head


class MemoryBudgetError(RuntimeError):
    """The settings cannot fit on the device: the message names the flag to change. Starting
    again with the same settings fails the same way, so the executor exits without a restart
    (pagedserve.supervise.EXIT_CONFIG)."""


def resolve_step_bounds(cfg: ExecutorConfig, device: torch.device) -> ExecutorConfig:
    """cfg with a 0 step bound replaced by the device's default (core.config.step_bounds)."""
    if cfg.max_num_seqs > 0 and cfg.max_num_batched_tokens > 0:
        return cfg
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        seqs, tokens = step_bounds("cuda", props.total_memory, props.name)
    else:
        seqs, tokens = step_bounds(device.type)
    return replace(cfg, max_num_seqs=cfg.max_num_seqs or seqs,
                   max_num_batched_tokens=cfg.max_num_batched_tokens or tokens)


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device,
                     backend: str) -> torch.dtype:
    """The KV cache's element type for --kv-cache-dtype `name` (ValueError: cannot be used)."""
    if name == "auto":
        return dtype
    if name != "fp8":
        raise ValueError(f"kv cache dtype must be auto or fp8, got {name!r}")
    if device.type == "cuda" and backend == "triton" and \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or newer "
                         f"(Ada, Hopper), for Triton's e4m3 casts; {device} is "
                         f"{torch.cuda.get_device_name(device)}")
    return torch.float8_e4m3fn


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                layers: int, shared: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V cache. Their contents need no initialising (attention never reads
    a slot before it is written), but host memory is committed here, page by page, so that the
    resident memory at start is the memory under load: a container's limit is met at start, not
    mid-service as the blocks are first written (device memory is committed when allocated).
    shared: K and V are one tensor (latent attention's latent is its own value)."""
    kv = []
    for _ in range(layers):
        k = torch.empty(shape, dtype=dtype, device=device)
        kv.append((k, k if shared else torch.empty(shape, dtype=dtype, device=device)))
    if device.type == "cpu":
        commit(t for layer in kv for t in distinct_caches(layer))
    return kv


def swap_space_bytes(cfg: ExecutorConfig, device: torch.device) -> int:
    """The swap space's size: as configured, or by device. On a GPU it is pinned host memory
    beside the device's cache; on the CPU the cache is host memory already, and swapping would
    copy it into more of the same, which the KV cache itself could have used."""
    if cfg.swap_space_bytes is not None:
        return cfg.swap_space_bytes
    return DEFAULT_SWAP_SPACE_BYTES if device.type == "cuda" else 0


def commit(tensors: Iterable[torch.Tensor]) -> None:
    """Touch every page of these host tensors (an untouched allocation is only reserved)."""
    for t in tensors:
        t.view(torch.uint8).zero_()


def load_ops(backend: str) -> SimpleNamespace:
    from pagedserve.kernels import get_ops

    return get_ops(backend)


class Worker:
    def __init__(self, cfg: ExecutorConfig) -> None:
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        cfg = resolve_step_bounds(cfg, self.device)
        log.info("step bounds: %d sequences, %d tokens", cfg.max_num_seqs,
                 cfg.max_num_batched_tokens)
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
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype, self.device, backend)
        if cfg.load_format not in ("auto", "random"):
            raise ValueError(f"load format must be auto or random, got {cfg.load_format!r}")
        self.whole_cfg = ModelConfig.from_pretrained(cfg.model, cfg.model_impl)
        self.model_cfg = self.whole_cfg.for_rank(cfg.tensor_parallel_rank,
                                                 cfg.tensor_parallel_size)
        weights = Path(cfg.model) if cfg.load_format == "auto" else None
        quant = resolve_quantization(cfg.model, cfg.quantization, random=weights is None)
        max_len = cfg.max_model_len or self.model_cfg.max_position_embeddings
        if self.model_cfg.exact_len and max_len > self.model_cfg.exact_len:
            raise UnsupportedModelError(
                f"{self.model_cfg.model_type} attends in chunks of "
                f"{self.model_cfg.exact_len} tokens (attention_chunk_size), a mask the "
                f"transformers fallback does not apply: --max-model-len at most "
                f"{self.model_cfg.exact_len}")
        with phase(f"loading weights of {cfg.model} onto {self.device}"):
            model = build_model(self.model_cfg, load_ops(backend), self.dtype, self.device,
                                max_len, weights, quant=quant)
        self.draft_cfg, draft_model = self._load_draft(cfg, backend, max_len, model)
        self.lora = self._load_lora(cfg, model, backend)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.lora is not None:  # its slots are device memory the KV cache cannot have
            self.weight_bytes += self.lora.slots.nbytes()
        if draft_model is not None:
            self.weight_bytes += sum(p.numel() * p.element_size()
                                     for p in draft_model.parameters())
        if self.kv_dtype == torch.float8_e4m3fn:
            log.info("FP8 KV cache: %s", model.kv_scales_summary())
        log.info("model weights: %.2f GiB on %s%s", self.weight_bytes / GiB, self.device,
                 f" ({quant.describe()})" if quant else "")
        self.block_size = cfg.block_size
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self._graph_estimate = 0  # what the memory profile set aside for the graphs (0: none)
        self.sampler = Sampler(self.device)
        self.counts = TokenCounts(self.model_cfg.vocab_size, self.device)
        # bytes of one KV block of every layer, in the cache's own element type (an FP8 cache
        # holds twice the tokens of a bf16 one in the same memory)
        self.block_bytes = per_block = cfg.block_size * self.model_cfg.kv_bytes_per_token(
            self.kv_dtype.itemsize)
        if self.draft_cfg is not None:  # the draft's KV lives in the same blocks
            self.block_bytes = per_block = per_block + cfg.block_size * \
                self.draft_cfg.kv_bytes_per_token(self.kv_dtype.itemsize)
        self.num_blocks = self._num_blocks(cfg, model, max_len, draft_model)
        if cfg.tensor_parallel_size > 1:  # every rank holds its heads of every block
            from pagedserve.executor.tp_layers import min_over_ranks

            self.num_blocks = min_over_ranks(self.num_blocks, self.device)
        if self.num_blocks < 1:
            raise MemoryBudgetError(
                f"--kv-cache-gib {cfg.kv_cache_bytes / GiB:.3g} holds no KV block of "
                f"{per_block} bytes; raise --kv-cache-gib")
        capacity_tokens = self.num_blocks * cfg.block_size
        if cfg.max_model_len > capacity_tokens:
            raise RuntimeError(
                f"max_model_len {cfg.max_model_len} does not fit in the KV cache: "
                f"{self.num_blocks} blocks hold {capacity_tokens} tokens; lower --max-model-len "
                f"or give the cache more memory (--gpu-memory-utilization, --kv-cache-gib)")
        if max_len > capacity_tokens:
            log.warning("the model's max_model_len %d is more than the KV cache holds; serving "
                        "at most %d tokens per sequence", max_len, capacity_tokens)
        self.max_model_len = min(max_len, capacity_tokens)
        shape = (self.num_blocks, cfg.block_size, self.model_cfg.num_kv_heads,
                 self.model_cfg.head_dim)
        kv = allocate_kv(shape, self.kv_dtype, self.device, self.model_cfg.num_layers,
                         shared=self.model_cfg.latent is not None)
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB of %s (%d sequences of "
                 "max_model_len %d at once)", self.num_blocks, cfg.block_size, capacity_tokens,
                 self.num_blocks * per_block / GiB, dtype_str(self.kv_dtype),
                 capacity_tokens // self.max_model_len, self.max_model_len)
        draft = None
        if draft_model is not None:
            dc = self.draft_cfg
            draft_kv = allocate_kv((self.num_blocks, cfg.block_size, dc.num_kv_heads,
                                    dc.head_dim), self.kv_dtype, self.device, dc.num_layers)
            kind = EagleDraft if isinstance(draft_model, EagleHead) else DraftModel
            draft = kind(draft_model, draft_kv, cfg.block_size, self.device)
        self.swap = SwapSpace(swap_space_bytes(cfg, self.device) // per_block,
                              kv + (draft.kv_caches if draft is not None else []))
        self.runner = ModelRunner(model, kv, cfg.block_size, self.device, self.sampler,
                                  self.swap, self.counts, draft, self.lora)
        self.graphs: DecodeGraphs | None = None
        if on_cuda and backend == "triton" and not cfg.enforce_eager \
                and self.model_cfg.impl == "native":  # HF's modeling code runs eagerly
            self.graphs = DecodeGraphs(
                model, kv, cfg.max_num_seqs, self.max_model_len, cfg.block_size, self.device,
                *((self.lora.step, cfg.lora.max_loras) if self.lora is not None else ()))
            if isinstance(draft, DraftModel):  # its mirror of a graphed step and proposals
                draft.graphs = DecodeGraphs(draft_model, draft.kv_caches, cfg.max_num_seqs,
                                            self.max_model_len, cfg.block_size, self.device)
            elif isinstance(draft, EagleDraft):  # the head's proposal passes
                draft.graphs = HeadGraphs(draft_model, draft.kv_caches, cfg.max_num_seqs,
                                          cfg.block_size, self.device)
        self.capacity = pb.Capacity(
            num_kv_blocks=self.num_blocks, block_size=cfg.block_size,
            max_model_len=self.max_model_len, vocab_size=self.model_cfg.vocab_size,
            dtype=dtype_name, device=str(self.device), attention_backend=backend,
            num_swap_blocks=self.swap.num_blocks,
            # the bounds its memory profile and graphs cover (CPU: 0, unbounded)
            max_num_batched_tokens=cfg.max_num_batched_tokens if on_cuda else 0,
            max_num_seqs=cfg.max_num_seqs if on_cuda else 0,
            weight_bytes=self.weight_bytes, kv_cache_dtype=dtype_str(self.kv_dtype),
            draft_model=cfg.draft_model,
        )
        if cfg.lora is not None:
            self.capacity.lora_adapters.extend(cfg.lora.names)
            self.capacity.max_loras, self.capacity.max_lora_rank = (cfg.lora.max_loras,
                                                                    cfg.lora.max_lora_rank)
        self._memory_at, self._memory = 0.0, (0, 0)
        log.info("executor ready: %d KV blocks of %d tokens, max_model_len %d, %s on %s (%s)",
                 self.num_blocks, cfg.block_size, self.max_model_len, dtype_name, self.device,
                 backend)

    def _load_lora(self, cfg: ExecutorConfig, model: CausalLM, backend: str
                   ) -> LoraRuntime | None:
        """The LoRA adapters (--enable-lora), read and checked against the model, and their
        device slots; LoraError naming the first that cannot serve."""
        if cfg.lora is None:
            return None
        with phase(f"loading {len(cfg.lora.modules)} LoRA adapters"):
            runtime = build_lora(model, self.model_cfg, cfg.lora, self.dtype, self.device,
                                 load_ops(backend), self.whole_cfg)
        log.info("LoRA: %d adapters in host memory, %d device slots of rank %d (%.1f MiB)",
                 len(runtime.host.sources), cfg.lora.max_loras, cfg.lora.max_lora_rank,
                 runtime.slots.nbytes() / (1 << 20))
        return runtime

    def _load_draft(self, cfg: ExecutorConfig, backend: str, max_len: int, target: CausalLM
                    ) -> tuple[ModelConfig | None, CausalLM | EagleHead | None]:
        """The draft model (--speculative-config method draft_model) or EAGLE head (eagle,
        eagle3), loaded as the target is (same device, dtype and load format);
        DraftModelError if it cannot serve beside it."""
        if not cfg.draft_model or cfg.tensor_parallel_rank > 0:
            return None, None  # (with tensor parallelism rank 0 alone holds and runs a draft)
        if cfg.draft_method != "draft_model":
            if not isinstance(target, CausalLM):
                raise DraftModelError("--speculative-config: an EAGLE head reads the hidden "
                                      "states of a native model; this one runs on HF's "
                                      "modeling code (--model-impl transformers)")
            with phase(f"loading the {cfg.draft_method} head {cfg.draft_model} onto "
                       f"{self.device}"):
                head = load_head(cfg.draft_method, cfg.draft_model, target, load_ops(backend),
                                 self.dtype, self.device, max_len,
                                 random=cfg.load_format != "auto", target_dir=cfg.model)
            target.taps = head.lay.taps
            return head.cfg, head
        dc = ModelConfig.from_pretrained(cfg.draft_model, cfg.model_impl)
        if dc.vocab_size != self.model_cfg.vocab_size:
            raise DraftModelError(
                f"--speculative-config: the draft {cfg.draft_model} has a vocabulary of "
                f"{dc.vocab_size} tokens, the target {self.model_cfg.vocab_size}: a draft must "
                f"share the target's tokenizer")
        weights = Path(cfg.draft_model) if cfg.load_format == "auto" else None
        quant = resolve_quantization(cfg.draft_model, "auto", random=weights is None)
        with phase(f"loading the draft model {cfg.draft_model} onto {self.device}"):
            model = build_model(dc, load_ops(backend), self.dtype, self.device,
                                max_len, weights, quant=quant)
        return dc, model

    def warm_up(self) -> None:
        """One small forward pass and sample before the executor says hello, so that the first
        real step pays no lazy initialisation and a broken model fails before it is announced;
        then the CUDA graphs are captured."""
        sizes = [min(8, self.block_size, self.max_model_len)]
        if self.device.type == "cuda":  # kernels pick their variant by rows (the W4A16 GEMMs'
            # bands, pick_config and pick_gluon_config in kernels/w4a16.py): compile each here,
            # not in a serving step
            sizes += [n for n in (24, 48, 96, 192) if n <= min(self.max_model_len,
                                                          self.max_num_batched_tokens)
                      and -(-n // self.block_size) <= self.num_blocks]
        compiled = self.device.type == "cuda" and self.backend == "triton"
        if compiled:
            from pagedserve.kernels import paged_attention as attention
        with phase(f"warm-up forwards of {sizes} tokens"), (
                attention.recording() if compiled else contextlib.nullcontext()) as kinds:
            for step, n in enumerate(sizes):
                req = pb.NewRequest(req_id=0, token_ids=[0] * n, num_computed_tokens=0,
                                    block_ids=list(range(-(-n // self.block_size))),
                                    sampling=pb.Sampling(temperature=0.0, top_p=1.0))
                self.runner.execute(pb.StepPlan(step_id=step, new_requests=[req],
                                                new_num_scheduled_tokens=[n]))
                self.runner.reset()  # the slots hold garbage now; nothing reads them unwritten
        if compiled and kinds:  # each layer kind's attention variants (splits, long rows'
            # configs, the Hopper kernel): the forwards above reach only some of them
            with phase(f"compiling the attention variants of {len(kinds)} layer kind(s)"):
                for kind in sorted(kinds, key=repr):
                    attention.warm_up_variants(kind)
        if self.lora is not None and self.backend == "triton":
            with phase("compiling the LoRA kernels"):
                warm_up_lora(self.lora, self.max_num_batched_tokens)
        if self.graphs is not None:
            draft = self.runner.draft or self.runner.eagle
            sets = [("decode", self.graphs)]
            if draft is not None and draft.graphs is not None:
                sets.append(("the EAGLE head's pass" if self.runner.eagle is not None
                             else "the draft model's decode", draft.graphs))
            for what, graphs in sets:
                with phase(f"capturing {what} CUDA graphs of batches up to {graphs.max_batch}"):
                    try:
                        graphs.capture()
                    except torch.OutOfMemoryError as e:  # the profile's estimate fell short
                        raise MemoryBudgetError(
                            f"capturing {what} CUDA graphs of up to {graphs.max_batch} "
                            f"sequences ran out of GPU memory ({str(e).splitlines()[0]}); "
                            f"lower --max-num-seqs or --gpu-memory-utilization, or pass "
                            f"--enforce-eager") from e
            took = sum(graphs.capture_bytes for _, graphs in sets)
            if 0 < self._graph_estimate < took - MARGIN:
                log.warning("the decode graphs took %.2f GiB, more than the memory profile's "
                            "%.2f GiB and its margin", took / GiB, self._graph_estimate / GiB)
            self.runner.graphs = self.graphs
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            log.info("GPU memory in use after start: %.2f of %.2f GiB", (total - free) / GiB,
                     total / GiB)

    def memory(self) -> tuple[int, int]:
        """(used, total) device memory in bytes; on CUDA at most one query per second."""
        now = time.monotonic()
        if now - self._memory_at >= 1.0:
            self._memory_at, self._memory = now, _memory_of(self.device)
        return self._memory

    def _num_blocks(self, cfg: ExecutorConfig, model: CausalLM, max_len: int,
                    draft: CausalLM | EagleHead | None = None) -> int:
        if cfg.num_kv_blocks > 0:
            return cfg.num_kv_blocks
        per_block = self.block_bytes
        if self.device.type != "cuda":
            return cfg.kv_cache_bytes // per_block
        with phase(f"profiling memory of a {cfg.max_num_batched_tokens}-token step"):
            try:
                peak = self._profile(model, cfg, max_len, prefill=True)
                graph_peak = 0 if cfg.enforce_eager else self._profile(
                    model, cfg, max_len, prefill=False) + DecodeGraphs.static_bytes(
                    cfg.max_num_seqs, max_len, cfg.block_size, self.model_cfg.vocab_size)
                if isinstance(draft, EagleHead):  # one layer on the target's states: its
                    # prefill pass is small beside the target's; graphs add their buffers
                    if not cfg.enforce_eager:
                        graph_peak += HeadGraphs.estimate_bytes(draft, cfg.max_num_seqs)
                elif draft is not None:  # a draft model runs steps of its own
                    peak = max(peak, self._profile(draft, cfg, max_len, prefill=True,
                                                   mc=self.draft_cfg))
                    if not cfg.enforce_eager:  # the draft's graphs have a pool of their own
                        graph_peak += self._profile(
                            draft, cfg, max_len, prefill=False, mc=self.draft_cfg) + \
                            DecodeGraphs.static_bytes(cfg.max_num_seqs, max_len,
                                                      cfg.block_size, self.model_cfg.vocab_size)
            except torch.OutOfMemoryError as e:  # the card cannot run the largest step at all
                raise MemoryBudgetError(
                    f"--max-num-seqs {cfg.max_num_seqs} and --max-num-batched-tokens "
                    f"{cfg.max_num_batched_tokens}: the largest step does not fit on the card "
                    f"beside the weights ({str(e).splitlines()[0]}); lower them") from e
        self._graph_estimate = graph_peak
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # CUDA context, weights, anything else on the card
        budget = int(total * cfg.gpu_memory_utilization) - used - peak - graph_peak - MARGIN
        log.info("memory profile: %.2f GiB in use after loading, step peak %.2f GiB "
                 "(%d tokens), decode-graph peak %.2f GiB, margin %.2f GiB; %.2f GiB of "
                 "%.2f x %.0f GiB left for the KV cache", used / GiB, peak / GiB,
                 cfg.max_num_batched_tokens, graph_peak / GiB, MARGIN / GiB,
                 max(0, budget) / GiB, cfg.gpu_memory_utilization, total / GiB)
        # at least one step's worth of KV: less could not run the step the bounds allow
        least = -(-min(cfg.max_num_batched_tokens, max_len) // cfg.block_size)
        if budget < least * per_block:
            raise MemoryBudgetError(budget_message(
                cfg, used, peak, graph_peak, total, least * per_block, max(0, budget)))
        return budget // per_block

    @torch.inference_mode()
    def _profile(self, model: CausalLM, cfg: ExecutorConfig, max_len: int,
                 prefill: bool, mc: ModelConfig | None = None) -> int:
        """Peak bytes allocated beyond what is held now by the largest step the scheduler may
        plan: prefill=True runs max_num_batched_tokens tokens over as many sequences as may
        sample (logits and top-k/top-p sampling of each); prefill=False one decode token for
        each of max_num_seqs sequences (what a CUDA graph's private pool holds). K/V writes
        are skipped and attention reads a one-block dummy cache: memory, not values, matters.
        mc: the model's config (the draft's for a draft model).
        """
        dev, mc = self.device, mc or self.model_cfg
        seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        tokens = cfg.max_num_batched_tokens if prefill else seqs
        seqs = max(seqs, -(-tokens // max_len))
        q_lens = np.full(seqs, tokens // seqs, np.int64)
        q_lens[: tokens % seqs] += 1
        cu_q = np.zeros(seqs + 1, np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        shape = (1, self.block_size, mc.num_kv_heads, mc.head_dim)
        kv = [(torch.zeros(shape, dtype=self.kv_dtype, device=dev),
               torch.zeros(shape, dtype=self.kv_dtype, device=dev)) for _ in range(mc.num_layers)]
        width = -(-int(q_lens.max()) // self.block_size)
        positions = np.concatenate([np.arange(n) for n in q_lens.tolist()])
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros((seqs, width), dtype=torch.int32, device=dev),
            seq_lens=torch.from_numpy(q_lens.astype(np.int32)).to(dev),
            cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)).to(dev),
            max_query_len=int(q_lens.max()), max_seq_len=int(q_lens.max()))
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base, allocated = torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)
        logits = model(torch.zeros(tokens, dtype=torch.int64, device=dev),
                       torch.from_numpy(positions).to(dev), kv, meta,
                       torch.from_numpy(cu_q[1:] - 1).to(dev))
        if prefill:  # the sampler's temporaries on the largest logits a step can make, with
            # every extra; the penalties' count slots of every sequence stay allocated after
            # (TokenCounts never shrinks), so they are in the memory in use, not in the KV cache
            spec = SamplingSpec(temperature=1.0, top_k=50, top_p=0.9, seed=0, min_p=0.05,
                                repetition_penalty=1.1, frequency_penalty=0.5,
                                logprobs=MAX_TOP_LOGPROBS)
            slots = [self.counts.acquire() for _ in range(seqs)]
            self.counts.load([(s, [0, 1], 1) for s in slots])
            self.sampler.sample(logits, SamplingBatch([spec] * seqs, [1] * seqs,
                                                      count_slots=slots, counts=self.counts))
            self.counts.reset()
        torch.cuda.synchronize(dev)
        if prefill:  # reserved, not allocated: the allocator's segments and rounding count too
            peak = torch.cuda.max_memory_reserved(dev) - base
        else:  # allocated: a graph's private pool cannot reuse the free space that segments
            # kept by the prefill profile hold (reserved then grew by nothing)
            peak = torch.cuda.max_memory_allocated(dev) - allocated
        if prefill:  # latent attention's expanded prompts, added whole: this step's are
            # short where many sequences may run (none expands), else counted twice
            expanded = max(tokens, layers.LATENT_EXPAND_TOKENS)
            peak += max((m.expand_bytes(expanded, self.kv_dtype) for m in model.modules()
                         if isinstance(m, layers.LatentAttention)), default=0)
        model.tapped = None  # (an EAGLE head's states, counted in the peak)
        del logits, kv, meta
        return peak

def budget_message(cfg: ExecutorConfig, used: int, peak: int, graph_peak: int, total: int,
                   least_kv: int, left: int) -> str:
    """One line: what the step bounds cost, what is left, and what to lower."""
    need = peak + graph_peak + MARGIN
    return (f"--max-num-seqs {cfg.max_num_seqs} and --max-num-batched-tokens "
            f"{cfg.max_num_batched_tokens} need {need / GiB:.2f} GiB (largest step "
            f"{peak / GiB:.2f}, decode graphs {graph_peak / GiB:.2f}, margin "
            f"{MARGIN / GiB:.2f}) beside {used / GiB:.2f} GiB of weights and context, leaving "
            f"{left / GiB:.2f} GiB of --gpu-memory-utilization {cfg.gpu_memory_utilization:g} "
            f"x {total / GiB:.1f} GiB for the KV cache, which needs at least "
            f"{least_kv / GiB:.2f} GiB; lower --max-num-seqs or --max-num-batched-tokens, or "
            f"raise --gpu-memory-utilization")


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def executor_config(args: argparse.Namespace, rank: int, size: int, device: str) -> ExecutorConfig:
    """The worker's config from the executor's flags (rank 0's and every follower's)."""
    from pagedserve.core.models import resolve_model

    return ExecutorConfig(
        model=str(resolve_model(args.model)), load_format=args.load_format, device=device,
        dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)), num_kv_blocks=args.num_kv_blocks,
        lora=lora_config(args),
        swap_space_bytes=None if args.swap_space_gib is None
        else int(args.swap_space_gib * (1 << 30)),
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager, tensor_parallel_size=size, tensor_parallel_rank=rank,
        model_impl=args.model_impl, **_draft(args),
    )


def _draft(args: argparse.Namespace) -> dict[str, str]:
    """The draft model's or EAGLE head's resolved path and the method, from
    --speculative-config (none without one, or with n-gram)."""
    from pagedserve.core.models import resolve_model
    from pagedserve.core.speculative import SpeculativeConfig, SpeculativeConfigError

    try:
        spec = SpeculativeConfig.parse(getattr(args, "speculative_config", ""))
    except SpeculativeConfigError as e:
        raise DraftModelError(str(e)) from None
    if spec is None or not spec.drafts_in_executor:
        return {}
    return {"draft_model": str(resolve_model(spec.model)), "draft_method": spec.method}
