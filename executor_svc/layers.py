"""The decoder's building blocks, shared by every family (families.py says which switches
each sets): RMSNorm, RoPE caches, paged attention with its per-family options, the gated MLP.

Tokens of all scheduled requests are flattened into one batch of T rows ("varlen"); the
attention metadata says which rows belong to which sequence and where their KV lives.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.executor import tp_layers as tp
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.quantization import (
    Fp8Linear,
    QuantConfig,
    QuantizationError,
    W4Linear,
)

Ops = Any  # the namespace kernels.get_ops() returns
# PAGEDSERVE_DENSE_GEMV_ROWS=N: a 16-bit Linear given at most N rows on CUDA whose weight is at
# most PAGEDSERVE_DENSE_GEMV_MAX_MIB runs kernels/gemv.py (one launch, no split-K reduce) instead
# of cuBLAS. Measured on an H100 (cd268e7, cold weights, bench_gemv.py): at one row it is faster
# on Qwen3-30B-A3B's qkv (8.8 against 9.8 us), o_proj (9.8 / 11.0) and router (2.7 / 5.0), and
# slower on Llama-3.1-8B's 48-112 MiB weights (qkv 22.2 / 20.5 us); at four rows slower
# everywhere. Hence the defaults: one row, weights up to 24 MiB (Qwen3-30B-A3B's qkv is 20;
# Llama-3.1-8B's o_proj, 32 and not timed, stays on cuBLAS). Qwen3-30B-A3B single stream: 227
# -> 237 out tok/s. 0 rows: off.
GEMV_ROWS = int(os.environ.get("PAGEDSERVE_DENSE_GEMV_ROWS", "1"))
GEMV_MAX_BYTES = int(float(os.environ.get("PAGEDSERVE_DENSE_GEMV_MAX_MIB", "24")) * 2**20)


def gemv_block(value: str | None) -> tuple[int, int] | None:
    """PAGEDSERVE_DENSE_GEMV_BLOCK=NxK: the GEMV's (BLOCK_N, BLOCK_K) for every weight, powers
    of two (to time one against another in the service); unset: kernels.gemv.dense_tiles."""
    if not value:
        return None
    try:
        n, k = (int(v) for v in value.lower().split("x"))
    except ValueError:
        n = k = 0
    if n < 1 or k < 1 or n & (n - 1) or k & (k - 1):
        raise ValueError(f"PAGEDSERVE_DENSE_GEMV_BLOCK={value!r}: NxK, powers of two")
    return n, k


GEMV_BLOCK = gemv_block(os.environ.get("PAGEDSERVE_DENSE_GEMV_BLOCK"))


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose forward takes kernels.gemv for
    a decode step's few rows in 16-bit on CUDA where GEMV_ROWS and GEMV_MAX_BYTES say so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (GEMV_ROWS and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= GEMV_ROWS
                and x.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype
                and x.stride(1) == 1 and w.stride(1) == 1
                and w.numel() * w.element_size() <= GEMV_MAX_BYTES):
            from pagedserve.kernels.gemv import gemv

            return gemv(x, w, self.bias, block=GEMV_BLOCK)
        return super().forward(x)


def make_linear(in_features: int, out_features: int, bias: bool, quant: QuantConfig | None,
                ops: Ops) -> nn.Module:
    if quant is None:
        return Linear(in_features, out_features, bias=bias)
    if quant.method == "fp8":
        return Fp8Linear(in_features, out_features, bias, quant, ops)
    return W4Linear(in_features, out_features, bias, quant, ops)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    max_query_len: int
    max_seq_len: int
    # the same per sequence on the host (numpy or lists), where the runner has them: eager
    # steps only; LatentAttention reads them (or copies them once from the device) to take
    # prompt chunks through expanded keys and values
    query_lens_host: Any = None
    seq_lens_host: Any = None
    latent_plan: Any = None  # LatentAttention's split of the step, made once for its layers

    def host_lens(self) -> tuple[list[int], list[int]]:
        """(query lengths, context lengths) per sequence as host ints; copied from the device
        once a step where the runner gave none (tensor-parallel ranks)."""
        if self.query_lens_host is None or self.seq_lens_host is None:
            cu = self.cu_seqlens_q.tolist()
            self.query_lens_host = [b - a for a, b in zip(cu, cu[1:], strict=False)]
            self.seq_lens_host = self.seq_lens.tolist()
        return [int(n) for n in self.query_lens_host], [int(n) for n in self.seq_lens_host]


def _inv_freq(cfg: ModelConfig, params: dict, layer_type: str | None,
              seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", "default")
    alpha = params.get("alpha") if rope_type == "dynamic" else None
    if rope_type == "default" or alpha:
        theta = params.get("rope_theta", getattr(cfg.hf_config, "rope_theta", 10000.0))
        dim = cfg.rotary_dim or (cfg.latent.rope if cfg.latent else cfg.head_dim)
        if alpha:  # Hunyuan's "dynamic" with a fixed alpha: a static NTK stretch of the base
            theta = theta * alpha ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (theta**exps), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, kwargs = cfg.hf_config, {"layer_type": layer_type} if layer_type else {}
    if not layer_type and params is not getattr(hf, "rope_parameters", None):
        hf = copy.copy(hf)  # another base (rope_cos_sin_cache's theta): HF reads the config's
        hf.rope_parameters = params
    return ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), seq_len, **kwargs)


def rope_theta(cfg: ModelConfig) -> float:
    """The base of the config's RoPE (of its full-attention layers where it has one a type)."""
    params = getattr(cfg.hf_config, "rope_parameters", None) or {}
    params = params.get("full_attention", params) if isinstance(params, dict) else {}
    return float(params.get("rope_theta", getattr(cfg.hf_config, "rope_theta", 10000.0)))


def rope_cos_sin_cache(cfg: ModelConfig, max_pos: int, device: torch.device,
                       layer_type: str | None = None, theta: float | None = None
                       ) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos in the first half, sin in the second (HF's convention),
    from HF's own rope_init_fn for every scaling type (llama3, linear, dynamic, yarn, longrope).
    `layer_type` picks one of a per-layer-type config's RoPEs (Gemma 3's sliding_attention).
    `theta` replaces the base (Granite SWA's per-layer bases), the scaling kept.

    LongRoPE: positions below original_max_position_embeddings rotate with the short factors,
    later ones with the long factors. HF switches the whole forward pass to the long factors
    once any position passes that length (so its cached keys keep the short ones); per
    position, a request's rotation does not depend on the others in its batch."""
    params = getattr(cfg.hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    elif isinstance(params.get("full_attention"), dict):
        params, layer_type = params["full_attention"], "full_attention"
    if theta is not None:
        params = {**params, "rope_theta": float(theta)}
    pos = torch.arange(max_pos, dtype=torch.float32)[:, None]
    inv_freq, scaling = _inv_freq(cfg, params, layer_type)
    freqs = pos * inv_freq.float()[None, :]
    cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    mscales = params.get("short_mscale"), params.get("long_mscale")
    if params.get("rope_type") == "longrope" and None not in mscales:
        # Phi-3.5-MoE (HF's PhimoeRotaryEmbedding): the short factors at every position,
        # scaled by short_mscale, or long_mscale where HF's batch reaches past the original
        # length (here: the positions past it; the released config's two are equal)
        orig = params["original_max_position_embeddings"]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        cache[:orig] *= float(mscales[0])
        cache[orig:] *= float(mscales[1])
    elif params.get("rope_type") == "longrope":
        orig = (params.get("original_max_position_embeddings")
                or cfg.hf_config.original_max_position_embeddings)
        if max_pos > orig:
            inv_long, scaling = _inv_freq(cfg, params, layer_type, seq_len=orig + 1)
            freqs = pos[orig:] * inv_long.float()[None, :]
            cache[orig:] = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    if cfg.rope_reversed:  # NanoChat's rotate_half (x2, -x1): a rotation by -theta
        cache[:, cache.shape[-1] // 2:] *= -1
    if cfg.rotary_dim:  # the passed dims pair among themselves with cos 1 and sin 0
        rot, pas = cfg.rotary_dim // 2, (cfg.head_dim - cfg.rotary_dim) // 2
        cache = torch.cat([cache[:, :rot], torch.ones(max_pos, pas), cache[:, rot:],
                           torch.zeros(max_pos, pas)], dim=-1)
    return cache.to(device)


def rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Partial or interleaved rotary embeddings as the fused rotation's full-head pairs (i
    with i + head_dim / 2): entry j is the checkpoint's dimension at position j of each q and
    k head. The rotated pairs (i with i + rotary_dim / 2 in HF's layout; 2i with 2i + 1 when
    interleaved, as GLM's) go to the pairs' first rotary_dim / 2 places, the passed
    dimensions to the rest, which rope_cos_sin_cache rotates by nothing. Scores q . k are the
    same under one permutation of both."""
    rot, pas = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first, second = (torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)) \
        if interleaved else (torch.arange(0, rot), torch.arange(rot, rotary_dim))
    return torch.cat([first, torch.arange(rotary_dim, rotary_dim + pas),
                      second, torch.arange(rotary_dim + pas, head_dim)])


def permute_heads(t: torch.Tensor, dim: int, cfg: ModelConfig) -> torch.Tensor:
    """t with each head's dimensions along `dim` (heads x head_dim) in rotary_order."""
    order = rotary_order(cfg.head_dim, cfg.rotary_dim or cfg.head_dim,
                         cfg.rotary_interleaved).to(t.device)
    shape = list(t.shape)
    heads = t.movedim(dim, 0).reshape(shape[dim] // cfg.head_dim, cfg.head_dim, -1)
    out = heads[:, order].reshape(shape[dim], *[s for i, s in enumerate(shape) if i != dim])
    return out.movedim(0, dim).contiguous()


class RMSNorm(nn.Module):
    """x / rms(x) * weight. A (1 + w) family (Gemma) stores 1 + w as the weight at load."""

    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.ops = eps, ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """(x - mean) / std * weight (+ bias), in float32 as Cohere's and StableLM's: RMSNorm's
    interface, the residual added first."""

    def __init__(self, size: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual
        out = torch.nn.functional.layer_norm(
            h.float(), h.shape[-1:], self.weight.float(),
            None if self.bias is None else self.bias.float(), self.eps)
        return out.to(h.dtype), h


def make_norm(size: int, cfg: ModelConfig, ops: Ops) -> nn.Module:
    """The family's norm over `size`: RMSNorm, or LayerNorm (cfg.norm_type)."""
    if cfg.norm_type == "layer":
        return LayerNorm(size, cfg.rms_norm_eps, cfg.norm_bias)
    return RMSNorm(size, cfg.rms_norm_eps, ops)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a whole projection whose columns are split over the tensor-parallel ranks
    (OLMo 2's q and k norms): the mean square is summed over every rank's slice."""

    def __init__(self, size: int, whole: int, eps: float, ops: Ops, cfg: ModelConfig) -> None:
        super().__init__(size, eps, ops)
        self.whole, self.cfg = whole, cfg

    def forward(self, x: torch.Tensor, residual: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.tp_size == 1:
            return super().forward(x)
        xf = x.float()
        sq = tp.all_reduce(xf.pow(2).sum(-1, keepdim=True), self.cfg)
        return self.weight * (xf * torch.rsqrt(sq / self.whole + self.eps)).to(x.dtype), x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = make_linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d,
                                    cfg.attention_bias, quant, ops)
        self.o_proj = make_linear(self.h * self.d, cfg.hidden_size, cfg.o_proj_bias, quant, ops)
        self.scale = cfg.attn_scale or self.d**-0.5
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else 0
        self.local_rope = cfg.local_rope and self.window > 0
        self.rope = not cfg.rope_layers or cfg.rope_layers[layer]  # else: no position encoding
        self.options = {}  # only what a family sets: the plain call stays as it was
        if self.window:
            self.options["sliding_window"] = self.window
        if cfg.attn_softcap:
            self.options["logits_soft_cap"] = cfg.attn_softcap
        # Ministral 3: q times a scale by position, [max_pos] float32 (CausalLM.set_rope)
        self.q_position_scale: torch.Tensor | None = None
        if cfg.attn_output_gate:  # AFMoE: a sigmoid gate per output column, from the input
            self.gate_proj = make_linear(cfg.hidden_size, self.h * self.d, False, quant, ops)
        if cfg.attn_sinks:  # gpt-oss: a logit per query head in the softmax, float32 as HF's
            self.sinks = nn.Parameter(torch.empty(self.h), requires_grad=False)
            self.fixed_dtypes = ("sinks",)
        if cfg.qk_norm in ("head", "head_after_rope"):
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, ops)
        elif cfg.qk_norm == "full":
            heads = cfg.hf_config.num_attention_heads
            kv_heads = getattr(cfg.hf_config, "num_key_value_heads", None) or heads
            if kv_heads < cfg.tp_size:  # ranks would hold copies: their squares count twice
                raise ValueError(f"a norm over the whole k projection needs at least as many "
                                 f"KV heads ({kv_heads}) as tensor parallel ranks")
            whole_q, whole_kv = heads * self.d, kv_heads * self.d
            self.q_norm = ShardedRMSNorm(self.h * self.d, whole_q, cfg.rms_norm_eps, ops, cfg)
            self.k_norm = ShardedRMSNorm(self.hkv * self.d, whole_kv, cfg.rms_norm_eps, ops, cfg)
        self.ops, self.cfg = ops, cfg
        # an FP8 cache stores K / k_scale and V / v_scale (the checkpoint's, else vLLM's 1.0);
        # other caches ignore them. Plain floats: CUDA graphs capture them as kernel arguments.
        self.k_scale, self.v_scale = 1.0, 1.0
        self.kv_scales_loaded = False

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.h, self.hkv, self.d
        q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], dim=-1)
        gate = self.gate_proj(x) if self.cfg.attn_output_gate else None
        norms = {}
        if self.cfg.qk_norm == "full":  # over the whole projection, before the heads split
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        elif self.cfg.qk_norm == "head":  # over each head: in the rotation's own pass
            norms = {"q_norm_weight": self.q_norm.weight, "k_norm_weight": self.k_norm.weight,
                     "norm_eps": self.q_norm.eps}
        k_cache, v_cache = kv_cache
        if self.cfg.qk_norm == "head_after_rope":  # Hunyuan: rotate, norm each head, store
            q, k = self.ops.rotary_embedding(positions, q.reshape(t, h, d), k.reshape(t, hkv, d),
                                             cos_sin)
            q = self.q_norm(q.reshape(t * h, d))[0].reshape(t, h, d)
            k = self.k_norm(k.reshape(t * hkv, d))[0].reshape(t, hkv, d)
            self.ops.write_kv_cache(k, v.reshape(t, hkv, d), k_cache, v_cache,
                                    meta.slot_mapping, self.k_scale, self.v_scale)
            return self._attend(q, kv_cache, meta, gate, positions)
        # q rotated; k rotated and v stored in the cache, in one pass
        q = self.ops.rotary_and_cache(positions, q.reshape(t, h, d), k.reshape(t, hkv, d),
                                      v.reshape(t, hkv, d), cos_sin, k_cache, v_cache,
                                      meta.slot_mapping, self.k_scale, self.v_scale, **norms)
        return self._attend(q, kv_cache, meta, gate, positions)

    def _attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, gate: torch.Tensor | None,
                positions: torch.Tensor) -> torch.Tensor:
        """The paged attention of rotated q [T, H, D] (scaled by position where the family
        does; this step's K and V already stored), times sigmoid(gate) [T, H x D] where the
        family gates it, then o_proj."""
        t, h, d = q.shape
        if self.q_position_scale is not None:  # (as HF: the scale in q's dtype, then times)
            q = q * self.q_position_scale[positions].to(q.dtype)[:, None, None]
        k_cache, v_cache = kv_cache
        o = self.ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, self.scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            k_scale=self.k_scale, v_scale=self.v_scale, **self.options,
            **({"sinks": self.sinks} if self.cfg.attn_sinks else {}),
        )
        o = o.reshape(t, h * d)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return tp.all_reduce(self.o_proj(o), self.cfg)


LATENT_GROUP = 16  # query heads a paged-attention program reads the latent for
# a sequence with at least this many query tokens in a step (a prompt or its chunk) attends
# through keys and values expanded from its cached latents (LatentAttention._expanded); 0: never
LATENT_EXPAND_ROWS = int(os.environ.get("PAGEDSERVE_LATENT_EXPAND_ROWS", "64"))
# the contexts a step expands add up to at most this many tokens, or the step's own tokens
# where more (the memory profile adds LatentAttention.expand_bytes of it)
LATENT_EXPAND_TOKENS = int(os.environ.get("PAGEDSERVE_LATENT_EXPAND_TOKENS", "32768"))


class LatentAttention(nn.Module):
    """Multi-head latent attention (families.Latent), absorbed: the cache's one KV head is
    [latent, rotated rope part] of kv_lora_rank + rope, both key and value (the paged
    attention reads the one tensor twice); each head's query is [q_nope @ W_UK, rotated
    q_rope], its output's first kv_lora_rank through W_UV, then o_proj. Scores and outputs
    equal HF's expanded keys and values (q_nope . W_UK c = (q_nope W_UK) . c).

    The checkpoint's names (HF's DeepseekV3Attention): q_proj, or q_a_proj, q_a_layernorm
    and q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj. With tensor
    parallelism each rank holds its heads of q, kv_b_proj and o_proj and the whole latent."""

    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        if quant is not None and (quant.method != "fp8" or quant.fp8_serialized):
            raise QuantizationError(f"{cfg.model_type}: latent attention takes float weights, "
                                    f"or FP8 quantized at load (--quantization fp8); "
                                    f"{quant.describe()} is not supported")
        lat, hidden, h = cfg.latent, cfg.hidden_size, cfg.num_heads
        self.lat, self.h = lat, h
        bias = cfg.attention_bias
        # FP8 at load (quantization.fp8.LINEARS): q_proj and o_proj; the low-rank
        # projections and kv_b_proj (W_UK, W_UV: absorbed) stay float
        if lat.q_lora_rank:
            self.q_a_proj = Linear(hidden, lat.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(lat.q_lora_rank, cfg.rms_norm_eps, ops)
            self.q_b_proj = Linear(lat.q_lora_rank, h * (lat.nope + lat.rope), bias=False)
        else:
            self.q_proj = make_linear(hidden, h * (lat.nope + lat.rope), False, quant, ops)
        self.kv_a_proj_with_mqa = Linear(hidden, lat.kv_lora_rank + lat.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(lat.kv_lora_rank, cfg.rms_norm_eps, ops)
        self.kv_b_proj = Linear(lat.kv_lora_rank, h * (lat.nope + lat.v), bias=False)
        self.o_proj = make_linear(h * lat.v, hidden, bias, quant, ops)
        self.scale = cfg.attn_scale
        # the query heads of the one KV head, in runs of at most LATENT_GROUP: the cache is
        # read as `splits` KV heads that alias it (a stride-0 view), so that the kernels
        # keep 16-row tiles at 576 lanes (the shape checked on a GPU) whatever the heads
        self.splits = next(s for s in range(1, h + 1) if h % s == 0 and h // s <= LATENT_GROUP)
        self.ops, self.cfg = ops, cfg
        self.k_scale, self.v_scale = 1.0, 1.0  # (an FP8 cache: the one tensor's scale)
        self.kv_scales_loaded = False
        self.rope, self.local_rope, self.q_position_scale = True, False, None  # (set_rope's)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        lat, t, h = self.lat, x.shape[0], self.h
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0]) if lat.q_lora_rank
             else self.q_proj(x)).view(t, h, lat.nope + lat.rope)
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[:, :lat.kv_lora_rank].contiguous())[0]
        q_rope, k_rope = self.ops.rotary_embedding(
            positions, q[..., lat.nope:].contiguous(),
            kv[:, lat.kv_lora_rank:].reshape(t, 1, lat.rope).contiguous(), cos_sin)
        if self.q_position_scale is not None:  # Mistral 4's (Llama 4's), as Attention's
            scale = self.q_position_scale[positions].to(q.dtype)[:, None, None]
            q, q_rope = q * scale, q_rope * scale.to(q_rope.dtype)
        k = torch.cat([latent, k_rope.reshape(t, lat.rope).to(latent.dtype)], dim=-1)[:, None]
        cache = kv_cache[0]
        self.ops.write_kv_cache(k, k, cache, kv_cache[1], meta.slot_mapping, self.k_scale,
                                self.k_scale)
        q_nope, q_rope = q[..., :lat.nope], q_rope.to(q.dtype)
        if meta.latent_plan is None:
            meta.latent_plan = (self._expand_plan(meta, t, cache.shape[1]),)
        plan = meta.latent_plan[0]
        if plan is None:
            o = self._absorbed(q_nope, q_rope, cache, meta)
        else:
            o = torch.empty(t, h, lat.v, dtype=q.dtype, device=q.device)
            (e_rows, e_meta, blocks), rest = plan
            o[e_rows] = self._expanded(q_nope[e_rows], q_rope[e_rows], cache, e_meta, blocks)
            if rest is not None:
                a_rows, a_meta = rest
                o[a_rows] = self._absorbed(q_nope[a_rows], q_rope[a_rows], cache, a_meta)
        return tp.all_reduce(self.o_proj(o.reshape(t, h * lat.v)), self.cfg)

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """[T, H, v]: each head's [q_nope W_UK, q_rope] against the cached latents, the
        output's first kv_lora_rank through W_UV."""
        lat, h = self.lat, self.h
        w = self.kv_b_proj.weight.view(h, lat.nope + lat.v, lat.kv_lora_rank)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :lat.nope])  # [H, T, R]
        q = torch.cat([q_latent.transpose(0, 1), q_rope.to(q_latent.dtype)], dim=-1)
        read = cache if self.splits == 1 else cache.expand(-1, -1, self.splits, -1)
        o = self.ops.paged_attention(
            q, read, read, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            self.scale, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            k_scale=self.k_scale, v_scale=self.k_scale)
        o = torch.bmm(o[..., :lat.kv_lora_rank].transpose(0, 1),
                      w[:, lat.nope:].transpose(1, 2))  # [H, T, v]
        return o.transpose(0, 1)

    def expand_bytes(self, tokens: int, cache_dtype: torch.dtype) -> int:
        """The most `_expanded` holds at once when the contexts it expands add up to
        `tokens` (its queries and outputs as many rows at most): the
        gathered latents (and their dequantized copy from an FP8 cache), kv_b_proj's output,
        the keys, values, queries and outputs. The memory profile adds it to its measured
        peak: its step's prompts, a few tokens each, expand none."""
        if not LATENT_EXPAND_ROWS:
            return 0
        lat, h, elt = self.lat, self.h, self.kv_b_proj.weight.element_size()
        width = max(lat.nope + lat.rope, lat.v)
        latent = (lat.kv_lora_rank + lat.rope) * (
            cache_dtype.itemsize + (elt if cache_dtype.itemsize != elt else 0))
        # (one more output's worth: the attention's split partials, allocator rounding)
        return tokens * (latent + elt * h * (lat.nope + lat.v + 5 * width))

    def _expand_plan(self, meta: AttentionMetadata, t: int, bs: int):
        """None (every sequence absorbed), or ((rows, metadata, blocks) of the sequences that
        attend through expanded keys and values, (rows, metadata) of the rest or None).

        A sequence is expanded when it has at least LATENT_EXPAND_ROWS query tokens: a prompt
        chunk of Q tokens over a context of C then costs C x kv_lora_rank x H x (nope + v)
        multiply-adds to expand and a head size of nope + rope to attend, where absorbed it
        attends at kv_lora_rank + rope lanes (padded to 1,024) with one query token a tile:
        about 64 / Q + 0.2 of the absorbed work at DeepSeek's sizes. Expanded contexts (their
        whole blocks) add up to at most LATENT_EXPAND_TOKENS or the step's tokens, the more,
        which bounds what it holds (expand_bytes, which the memory profile adds): a prompt
        chunk deeper than that in a long context stays absorbed."""
        if not LATENT_EXPAND_ROWS or meta.max_query_len < LATENT_EXPAND_ROWS:
            return None
        qlens, clens = meta.host_lens()
        budget, chosen = max(t, LATENT_EXPAND_TOKENS), []
        for i, (n, c) in enumerate(zip(qlens, clens, strict=True)):
            padded = -(-c // bs) * bs
            if n >= LATENT_EXPAND_ROWS and padded <= budget:
                chosen.append(i)
                budget -= padded
        if not chosen:
            return None
        dev = meta.block_tables.device
        taken = set(chosen)
        rest = [i for i in range(len(qlens)) if i not in taken]
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)

        def part(seqs: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
            rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
            cu = [0]
            for i in seqs:
                cu.append(cu[-1] + qlens[i])
            idx = torch.tensor(seqs, device=dev)
            return torch.tensor(rows, device=dev), AttentionMetadata(
                meta.slot_mapping, meta.block_tables[idx], meta.seq_lens[idx],
                torch.tensor(cu, dtype=torch.int32, device=dev),
                max(qlens[i] for i in seqs), max(clens[i] for i in seqs),
                [qlens[i] for i in seqs], [clens[i] for i in seqs])

        e_rows, e_meta = part(chosen)
        # the expanded sequences' blocks, gathered in a row of their own each: its table
        nblocks = [-(-clens[i] // bs) for i in chosen]
        seq_of = torch.tensor([j for j, n in enumerate(nblocks) for _ in range(n)], device=dev)
        col = torch.tensor([c for n in nblocks for c in range(n)], device=dev)
        blocks = e_meta.block_tables[seq_of, col].long()
        table = torch.zeros(len(chosen), max(nblocks), dtype=torch.int32, device=dev)
        table[seq_of, col] = torch.arange(len(col), dtype=torch.int32, device=dev)
        e_meta.block_tables = table
        return (e_rows, e_meta, blocks), (part(rest) if rest else None)

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata, blocks: torch.Tensor) -> torch.Tensor:
        """[T, H, v]: the sequences' cached latents (`blocks`, in meta.block_tables' order)
        through kv_b_proj into each head's key [k_nope, k_rope] and value, then attention
        of head size nope + rope (values zero-padded to it) as a model without latents."""
        lat, h = self.lat, self.h
        r = lat.kv_lora_rank
        width = max(lat.nope + lat.rope, lat.v)
        flat = cache[blocks].view(-1, r + lat.rope)  # [blocks x block size, R + rope]
        if flat.dtype != q_nope.dtype:  # an FP8 cache: stored / k_scale
            flat = flat.to(q_nope.dtype) * self.k_scale
        kv = nn.functional.linear(flat[:, :r], self.kv_b_proj.weight).view(-1, h, lat.nope + lat.v)
        k = flat.new_zeros(flat.shape[0], h, width)
        k[..., :lat.nope] = kv[..., :lat.nope]
        k[..., lat.nope:lat.nope + lat.rope] = flat[:, None, r:]
        v = flat.new_zeros(flat.shape[0], h, width)
        v[..., :lat.v] = kv[..., lat.nope:]
        q = q_nope.new_zeros(q_nope.shape[0], h, width)
        q[..., :lat.nope], q[..., lat.nope:lat.nope + lat.rope] = q_nope, q_rope
        shape = (blocks.shape[0], cache.shape[1], h, width)
        o = self.ops.paged_attention(
            q, k.view(shape), v.view(shape), meta.block_tables, meta.seq_lens,
            meta.cu_seqlens_q, self.scale, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len)
        return o[..., :lat.v]


class XIELU(nn.Module):
    """Apertus's xIELU activation with its learned parameters (HF's names and formula):
    alpha_p x^2 + beta x for x > 0, else alpha_n (expm1(min(x, eps)) - x) + beta x, with
    alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.empty(1), requires_grad=False)
        self.beta = nn.Parameter(torch.empty(()), requires_grad=False)
        self.eps = nn.Parameter(torch.empty(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = nn.functional.softplus(self.alpha_p)
        alpha_n = self.beta + nn.functional.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one projection (gate first); or,
    not gated, down(relu(up(x)) ** 2) (Jais 2, Nemotron) or down(xielu(up(x))) (Apertus).
    `bias`: on both projections (mlp_bias)."""

    def __init__(self, cfg: ModelConfig, ops: Ops, quant: QuantConfig | None = None,
                 width: int | None = None, bias: bool = False, gated: bool = True) -> None:
        super().__init__()
        width = width or cfg.intermediate_size
        self.gated = gated
        if gated:
            self.gate_up_proj = make_linear(cfg.hidden_size, 2 * width, bias, quant, ops)
            self.act = (ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_tanh"
                        else ops.silu_and_mul)
        else:
            self.up_proj = make_linear(cfg.hidden_size, width, bias, quant, ops)
            if cfg.hidden_act == "xielu":
                self.act_fn = XIELU()
        self.down_proj = make_linear(width, cfg.hidden_size, bias, quant, ops)
        self.cfg = cfg

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        if self.gated:
            h = self.act(self.gate_up_proj(x))
        elif self.cfg.hidden_act == "xielu":
            h = self.act_fn(self.up_proj(x))
        else:
            h = torch.relu(self.up_proj(x)) ** 2
        y = self.down_proj(h)
        return tp.all_reduce(y, self.cfg) if reduce else y
