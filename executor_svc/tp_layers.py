"""Megatron-LM tensor parallelism inside the model: what each rank holds and the collectives.

    qkv_proj, gate_up_proj   column-parallel: a rank holds its heads' (its MLP slice's) rows of
                             each fused part; no communication
    o_proj, down_proj        row-parallel: a rank holds the matching input columns; its partial
                             sums are added by one all_reduce per layer each
    LoRA adapters            sharded with their layers (shard_lora): column layers' B rows,
                             row layers' A columns; no communication of their own
    embed_tokens             vocabulary-parallel: a rank holds ceil(V / N) rows, looks up the
                             ids in its range (others read as zero rows), then all_reduce
    lm_head                  vocabulary-parallel: a rank computes its vocabulary slice's logits;
                             all_gather puts the whole row on every rank (rank 0 samples)

A rank's ModelConfig (ModelConfig.for_rank) counts its own heads; the loader slices each HF
tensor with `shard` before the fused parts are placed. 4-bit weights arrive in the kernels'
layout ([K/8, N] qweight, [K/G, N] scales and zeros, executor_svc/quantization): column layers
slice N, row layers slice K in whole groups. FP8 weights ([N, K] e4m3) slice as float ones; their
per-channel weight_scale [N] follows N (column) or is whole on every rank (row), as a static
input_scale always is. Dynamic activation scales of a row-parallel layer are each rank's own
(per token over its slice of the input): finer than one over the whole row, and no collective.
The collectives use torch.distributed's default group, which is the executor's ranks and
nothing else (executor_svc/distributed.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.quantization import QuantConfig, QuantizationError

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Sum of every rank's x (in place); x unchanged with one rank."""
    if cfg.tp_size > 1:
        dist.all_reduce(x)
    return x


def vocab_rows(cfg: ModelConfig) -> tuple[int, int]:
    """(first id, rows held) of this rank's vocabulary slice; rows past the vocabulary are
    padding (zero embeddings, logits dropped) so that every rank's slice has one size."""
    per = -(-cfg.vocab_size // cfg.tp_size)
    return cfg.tp_rank * per, per


def embed(emb: nn.Embedding, ids: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if cfg.tp_size == 1:
        return emb(ids)
    start, per = vocab_rows(cfg)
    local = ids - start
    outside = (local < 0) | (local >= per)
    x = F.embedding(local.masked_fill(outside, 0), emb.weight)
    return all_reduce(x.masked_fill_(outside[:, None], 0.0), cfg)


def logits(lm_head: nn.Linear, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[S, vocab] float32 next-token logits of the rows x [S, hidden], on every rank."""
    part = lm_head(x)  # [S, per]
    if cfg.tp_size == 1:
        return part.float()
    n, (s, per) = cfg.tp_size, part.shape
    whole = torch.empty((n * s, per), dtype=part.dtype, device=part.device)
    _all_gather(whole, part.contiguous())
    return whole.view(n, s, per).permute(1, 0, 2).reshape(s, n * per)[:, :cfg.vocab_size].float()


def shard(name: str, tensor: torch.Tensor, cfg: ModelConfig,
          quant: QuantConfig | None, width: int = 0) -> torch.Tensor:
    """This rank's slice of the checkpoint tensor `name` (HF names; 4-bit parts converted);
    width: this rank's share of an MLP's intermediate size other than the config's (a shared
    expert's)."""
    if cfg.tp_size == 1:
        return tensor
    module, _, kind = name.rpartition(".")
    proj = module.rpartition(".")[2]
    if module.endswith("self_attn.gate_proj"):  # AFMoE's output gate: q's heads, cut as q
        proj = "q_proj"
    if proj in _VOCAB:
        start, per = vocab_rows(cfg)
        return tensor[start:start + per]  # the last rank's may be short: padded by the loader
    if proj not in _COLUMN and proj not in _ROW:
        return tensor  # norms: every rank holds them whole
    if kind in ("weight_scale", "input_scale") and (proj in _ROW or tensor.numel() == 1):
        return tensor  # per tensor, or a row-parallel layer's output channels: all ranks'
    start, size = _range(proj, cfg, width)
    if proj in _COLUMN:  # output rows: dim 0 of a float weight or bias, dim 1 of 4-bit parts
        if kind == "perm":
            return tensor
        return tensor.narrow(1 if kind in ("qweight", "scales", "zeros") else 0, start, size)
    if kind == "weight":  # row-parallel: input columns
        return tensor.narrow(1, start, size)
    if kind == "qweight":
        return tensor.narrow(0, start // 8, size // 8)
    if kind in ("scales", "zeros"):
        g = quant.group_size if quant is not None else 1
        return tensor.narrow(0, start // g, size // g)
    if kind == "bias":  # a zero bias GPTQ writers add: only one rank may add it
        return tensor if cfg.tp_rank == 0 else torch.zeros_like(tensor)
    raise QuantizationError(f"{name}: cannot shard {kind} of a row-parallel layer")


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a LoRA adapter's A [r, in] and B [out, r] on `module`: a
    column-parallel layer's B rows (its output channels; A whole), a row-parallel layer's A
    columns (its input channels; B whole). Each rank then adds (x_rank @ A_rank.T) @ B.T, and
    the row-parallel partial deltas are summed by the layer's all-reduce with its output."""
    if cfg.tp_size == 1:
        return a, b
    start, size = _range(module, cfg)
    if module in _COLUMN:
        return a, b.narrow(0, start, size)
    return a.narrow(1, start, size), b


def _range(proj: str, cfg: ModelConfig, width: int = 0) -> tuple[int, int]:
    d = cfg.head_dim
    if proj in ("q_proj", "o_proj"):
        return cfg.head_start * d, cfg.num_heads * d
    if proj in ("k_proj", "v_proj"):
        return cfg.kv_head_start * d, cfg.num_kv_heads * d
    width = width or cfg.intermediate_size
    return cfg.tp_rank * width, width


def check_quant(cfg: ModelConfig, quant: QuantConfig | None) -> None:
    """Refuse a 4-bit checkpoint whose row-parallel layers cannot be cut in whole groups."""
    if cfg.tp_size == 1 or quant is None or quant.method == "fp8":
        return  # FP8 scales are per output channel: any split of the input is whole
    if quant.act_order:
        raise QuantizationError("GPTQ act-order (desc_act) checkpoints cannot be served with "
                                "--tensor-parallel-size > 1: their groups span the input "
                                "channels that the ranks split")
    shared = cfg.moe.shared_intermediate_size if cfg.moe is not None else 0
    for proj, width in [(p, 0) for p in _ROW] + ([("down_proj", shared)] if shared else []):
        start, size = _range(proj, cfg, width)
        if start % quant.group_size or size % quant.group_size:
            raise QuantizationError(
                f"{quant.method} group size {quant.group_size}: rank {cfg.tp_rank} of "
                f"{cfg.tp_size} would hold input channels {start}..{start + size} of "
                f"{'the shared expert' if width else proj}, not whole groups; use another "
                f"--tensor-parallel-size")

def min_over_ranks(n: int, device: torch.device) -> int:
    """The smallest of every rank's n (e.g. KV blocks: the cache size all ranks can hold)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
