"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Tokens of all scheduled requests are flattened into one batch of T rows ("varlen"); the
attention metadata says which rows belong to which sequence and where their KV lives.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.executor import tp_layers as tp
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.quantization import Fp8Linear, QuantConfig, QuantizationError, W4Linear

Ops = Any  # the namespace kernels.get_ops() returns
_PACKED_ALONG_N = (".qweight", ".scales", ".zeros")  # fused parts concatenate along dim 1
_FP8_SCALES = (".weight_scale", ".input_scale")  # one per output row (quantization/fp8.py)
# FP8 KV-cache scales as checkpoints name them (vLLM's loader reads the same): k_scale/v_scale,
# an older kv_scale for both, compressed-tensors' k_proj/v_proj output_scale
_KV_SCALE = re.compile(r"^layers\.(\d+)\.self_attn\.(k|v|kv)(?:_scale|_proj\.output_scale)$")


def make_linear(in_features: int, out_features: int, bias: bool, quant: QuantConfig | None,
                ops: Ops) -> nn.Module:
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias)
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


def rope_cos_sin_cache(cfg: ModelConfig, max_pos: int, device: torch.device) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos in the first half, sin in the second (HF's convention)."""
    params = getattr(cfg.hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(cfg.hf_config, "rope_theta", 10000.0))
        exps = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
        inv_freq, scaling = 1.0 / (theta**exps), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg.hf_config, torch.device("cpu"))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).to(device)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.ops = eps, ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = make_linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d,
                                    cfg.attention_bias, quant, ops)
        self.o_proj = make_linear(self.h * self.d, cfg.hidden_size, False, quant, ops)
        self.scale = self.d**-0.5
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
        t = x.shape[0]
        sizes = [self.h * self.d, self.hkv * self.d, self.hkv * self.d]
        q, k, v = self.qkv_proj(x).split(sizes, dim=-1)
        q, k = self.ops.rotary_embedding(
            positions, q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), cos_sin
        )
        k_cache, v_cache = kv_cache
        self.ops.write_kv_cache(k, v.view(t, self.hkv, self.d), k_cache, v_cache,
                                meta.slot_mapping, self.k_scale, self.v_scale)
        o = self.ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, self.scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )
        return tp.all_reduce(self.o_proj(o.reshape(t, self.h * self.d)), self.cfg)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(cfg.hidden_size, 2 * cfg.intermediate_size, False,
                                        quant, ops)
        self.down_proj = make_linear(cfg.intermediate_size, cfg.hidden_size, False, quant, ops)
        self.ops, self.cfg = ops, cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))),
                             self.cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ops, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops, quant)

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, max_pos: int,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.cfg, self.quant = cfg, quant
        tp.check_quant(cfg, quant)
        # embeddings, norms and lm_head stay in float whatever `quant` says; with tensor
        # parallelism each rank holds its slice of the vocabulary (tp_layers)
        vocab = tp.vocab_rows(cfg)[1]
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, quant) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # [max_pos, head_dim] float32; filled on the model's device by the loader
        self.cos_sin = torch.empty(0)
        self.max_pos = max_pos

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] rows whose next-token logits are needed
        out: torch.Tensor | None = None,  # [S, vocab] float32 to write the logits into
    ) -> torch.Tensor:  # [S, vocab] float32
        logits = self.logits(self.hidden(input_ids, positions, kv_caches, meta)[logits_indices])
        return logits if out is None else out.copy_(logits)

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]: the final norm's output
        x = tp.embed(self.embed_tokens, input_ids, self.cfg)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.cos_sin, kv, meta)
        x, _ = self.norm(x, residual)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] fp32
        return tp.logits(self.lm_head, hidden, self.cfg)

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits of hidden's rows (with tensor parallelism every rank calls this alike)."""
        return self.logits(hidden[rows])

    def kv_scales_summary(self) -> str:
        attn = [layer.self_attn for layer in self.layers]
        loaded = sum(a.kv_scales_loaded for a in attn)
        if not loaded:
            return "no k_scale/v_scale in the checkpoint: scales 1.0 (vLLM's default)"
        ks, vs = [a.k_scale for a in attn], [a.v_scale for a in attn]
        return (f"scales of {loaded}/{len(attn)} layers from the checkpoint (k {min(ks):.4g}.."
                f"{max(ks):.4g}, v {min(vs):.4g}..{max(vs):.4g}), others 1.0")

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Takes an FP8 KV-cache scale (per tensor; a per-head one counts as its largest, which
        saturates no head); False for any other weight."""
        m = _KV_SCALE.match(name)
        if m is None:
            return False
        value = float(tensor.float().max())
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{name}: an FP8 KV scale must be positive and finite, got {value}")
        attn = self.layers[int(m.group(1))].self_attn
        if m.group(2) in ("k", "kv"):
            attn.k_scale = value
        if m.group(2) in ("v", "kv"):
            attn.v_scale = value
        attn.kv_scales_loaded = True
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up projections. Quantized modules come
        already converted (quantization.convert_checkpoint): their parts fuse along N. With
        tensor parallelism each tensor is cut to this rank's slice first (tp_layers.shard)."""
        params = dict(self.named_parameters())
        h, hkv, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        qkv_rows = {"q": (0, h * d), "k": (h * d, hkv * d), "v": ((h + hkv) * d, hkv * d)}
        inter = self.cfg.intermediate_size
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or self._load_kv_scale(name, tensor):
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, rows = name, None
            for part, (start, size) in qkv_rows.items():
                if f"self_attn.{part}_proj." in name:
                    target = name.replace(f"{part}_proj", "qkv_proj")
                    rows = (start, size)
            for i, part in enumerate(("gate", "up")):
                if f"mlp.{part}_proj." in name:
                    target, rows = name.replace(f"{part}_proj", "gate_up_proj"), (i * inter, inter)
            if target not in params:
                if name.endswith(".bias") and not tensor.any():
                    continue  # GPTQ writers add zero biases to bias-free layers
                raise KeyError(f"unexpected weight {name}")
            dst = params[target].data
            tensor = tp.shard(name, tensor, self.cfg, self.quant)
            if dst.shape[0] > tensor.shape[0] and name.rpartition(".")[0].endswith(
                    ("embed_tokens", "lm_head")):  # the last rank's vocabulary slice: padded
                dst[tensor.shape[0]:].zero_()
                dst = dst[:tensor.shape[0]]
            if target.endswith(".perm"):
                if rows is not None and any(x.startswith(f"{target}[") for x in loaded) \
                        and not torch.equal(dst, tensor.to(dst.dtype)):
                    raise QuantizationError(f"{name}: g_idx differs from the other parts of "
                                            f"the fused {target.rpartition('.')[0]}")
            elif rows is not None:
                dst = dst.narrow(1 if target.endswith(_PACKED_ALONG_N) else 0, *rows)
            if target.endswith(_FP8_SCALES) and tensor.numel() == 1:
                tensor = tensor.expand(dst.shape)  # per tensor: the same scale on every row
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if rows is None else f"{target}[{rows[0]}]")
        expected = sum(3 if ".qkv_proj." in n else 2 if "gate_up" in n else 1 for n in params)
        if len(loaded) != expected:
            raise ValueError(f"checkpoint filled {len(loaded)} of {expected} weight tensors")
