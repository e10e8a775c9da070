"""The decoder over a paged KV cache that every supported family runs (families.py lists them
and what each switches on; layers.py and moe.py hold the blocks).

Tokens of all scheduled requests are flattened into one batch of T rows ("varlen"); the
attention metadata says which rows belong to which sequence and where their KV lives.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.executor import tp_layers as tp
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.families import text_weight_name
from pagedserve.executor.layers import (
    MLP,
    Attention,
    AttentionMetadata,
    LatentAttention,
    Ops,
    make_norm,
    permute_heads,
    rope_cos_sin_cache,
    rope_theta,
)
from pagedserve.executor.moe import SparseMoe
from pagedserve.executor.quantization import QuantConfig, QuantizationError
from pagedserve.kernels.fp8_reference import FP8

__all__ = ["AttentionMetadata", "CausalLM", "Ops", "rope_cos_sin_cache"]
log = logging.getLogger("pagedserve.executor")
_PACKED_ALONG_N = (".qweight", ".scales", ".zeros")  # fused parts concatenate along dim 1
_FP8_SCALES = (".weight_scale", ".input_scale")  # one per output row (quantization/fp8.py)
# FP8 KV-cache scales as checkpoints name them (vLLM's loader reads the same): k_scale/v_scale,
# an older kv_scale for both, compressed-tensors' k_proj/v_proj output_scale
_KV_SCALE = re.compile(r"^layers\.(\d+)\.self_attn\.(k|v|kv)(?:_scale|_proj\.output_scale)$")
# one expert's tensor: Mixtral's w1 (gate) / w3 (up) / w2 (down), Qwen's gate/up/down_proj
_EXPERT = re.compile(r"^(layers\.\d+\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_NORMS = {"pre": ("input_layernorm", "post_attention_layernorm"),
          "sandwich": ("input_layernorm", "post_attention_layernorm",
                       "pre_feedforward_layernorm", "post_feedforward_layernorm"),
          "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
          "parallel": ("input_layernorm",)}


class DecoderLayer(nn.Module):
    """Attention then MLP (dense or experts), with the family's norm placement: "pre" (Llama),
    "sandwich" (Gemma: pre and post each block) or "post" (OLMo 2: after each block only).
    Layers pass (x, residual), whose sum is the hidden state, so that an RMSNorm fuses the
    residual add."""

    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.style, self.residual_scale = cfg.norm_style, cfg.residual_scale
        for name in _NORMS[self.style]:
            setattr(self, name, make_norm(cfg.hidden_size, cfg, ops))
        self.self_attn = (LatentAttention if cfg.latent else Attention)(cfg, layer, ops, quant)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer]
        self.mlp = SparseMoe(cfg, ops, quant) if sparse else MLP(
            cfg, ops, quant, bias=cfg.mlp_bias, gated=cfg.mlp_gated)

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta):
        attn = self.self_attn
        if self.style == "pre":
            x, residual = self.input_layernorm(x, residual)
            x = attn(x, positions, cos_sin, kv_cache, meta)
            if self.residual_scale != 1.0:  # Granite: residual + sublayer * multiplier
                x = x * self.residual_scale
            x, residual = self.post_attention_layernorm(x, residual)
            x = self.mlp(x)
            return (x if self.residual_scale == 1.0 else x * self.residual_scale), residual
        if self.style == "parallel":  # residual + attn(norm(h)) + mlp(norm(h))
            x, residual = self.input_layernorm(x, residual)
            return attn(x, positions, cos_sin, kv_cache, meta) + self.mlp(x), residual
        if self.style == "sandwich":
            x, residual = self.input_layernorm(x, residual)
            x = self.post_attention_layernorm(attn(x, positions, cos_sin, kv_cache, meta))[0]
            if self.residual_scale != 1.0:  # HyperCLOVAX: the normed output times it
                x = x * self.residual_scale
            x, residual = self.pre_feedforward_layernorm(x, residual)
            x = self.post_feedforward_layernorm(self.mlp(x))[0]
            return (x if self.residual_scale == 1.0 else x * self.residual_scale), residual
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(attn(h, positions, cos_sin, kv_cache, meta))[0]
        return self.post_feedforward_layernorm(self.mlp(h))[0], h


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, max_pos: int,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.cfg, self.quant = cfg, quant
        tp.check_quant(cfg, quant)
        # embeddings, norms and lm_head stay in float whatever `quant` says; with tensor
        # parallelism each rank holds its slice of the vocabulary (tp_layers)
        vocab = tp.vocab_rows(cfg)[1]
        # built on the meta device (loader.build_model): no initial draw, which on meta goes
        # through torch's reference ops and imports torch._dynamo (~0.6 s of every start)
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size,
                                         _weight=torch.empty(vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, quant)
                                    for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.hidden_size, cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=cfg.lm_head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # [max_pos, head_dim] float32, filled on the model's device by the loader
        # (set_rope): cos_sin the config's RoPE, layer_cos_sin each layer's: cos_sin, the
        # windowed layers' own (Gemma 3's sliding_attention RoPE), one of another base
        # (Granite SWA's layer_rope_theta), or a rotation by nothing (cos 1, sin 0) for a
        # layer without RoPE (SmolLM3)
        self.cos_sin = torch.empty(0)
        self.layer_cos_sin: list[torch.Tensor] = []
        self.max_pos = max_pos
        # hidden states an EAGLE head reads (executor_svc/eagle.py): the input of each layer
        # in `taps` (its residual stream), num_layers for the final norm's output; hidden()
        # leaves them in `tapped`, concatenated along the hidden dimension, [T, len(taps) x H]
        self.taps: tuple[int, ...] = ()
        self.tapped: torch.Tensor | None = None

    def set_rope(self, device: torch.device) -> None:
        cfg = self.cfg
        self.cos_sin = rope_cos_sin_cache(cfg, self.max_pos, device)
        tables: dict[object, torch.Tensor] = {None: self.cos_sin}

        def table(key: object) -> torch.Tensor:
            if key not in tables:
                if key == "none":  # cos 1 in the first half, sin 0 in the second
                    half = self.cos_sin.shape[-1] // 2
                    tables[key] = torch.cat([torch.ones_like(self.cos_sin[:, :half]),
                                             torch.zeros_like(self.cos_sin[:, half:])], -1)
                elif key == "local":
                    tables[key] = rope_cos_sin_cache(cfg, self.max_pos, device,
                                                     "sliding_attention")
                else:
                    tables[key] = rope_cos_sin_cache(cfg, self.max_pos, device, theta=key)
            return tables[key]

        self.layer_cos_sin = []
        q_scale = None
        if cfg.q_position_scale:  # Llama 4's: 1 + beta * log(1 + floor(pos / orig))
            beta, orig = cfg.q_position_scale
            pos = torch.arange(self.max_pos, dtype=torch.float32)
            q_scale = (1 + beta * torch.log(1 + torch.floor(pos / orig))).to(device)
        base = rope_theta(cfg)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            attn.q_position_scale = q_scale
            theta = cfg.layer_rope_theta[i] if cfg.layer_rope_theta else None
            self.layer_cos_sin.append(table(
                "none" if not attn.rope else "local" if attn.local_rope
                else theta if theta and theta != base else None))

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
        if self.cfg.embed_scale != 1.0:  # Gemma: the scale rounded to the weights' dtype, as HF
            scale = self.cfg.embed_scale
            x = x * (torch.tensor(scale, dtype=x.dtype) if self.cfg.embed_scale_in_dtype
                     else scale)
        if self.cfg.embed_norm:  # NanoChat: the final (weightless) norm right after them too
            x = self.norm(x)[0]
        residual, taps, kept = None, self.taps, []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in taps:  # (in layer order, a layer listed twice twice, as vLLM)
                kept += [x if residual is None else x + residual] * taps.count(i)
            x, residual = layer(x, residual, positions, self.layer_cos_sin[i], kv, meta)
        x, _ = self.norm(x, residual)
        if taps:
            if len(self.layers) in taps:
                kept.append(x)
            self.tapped = kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] fp32
        logits = tp.logits(self.lm_head, hidden, self.cfg)
        if self.cfg.logit_scale != 1.0:  # Granite: logits / logits_scaling
            logits = logits * self.cfg.logit_scale
        cap = self.cfg.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

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
        """Load HF-named tensors, fusing q/k/v and gate/up projections (a checkpoint that
        fuses them itself, as Phi-3's, is split first) and stacking experts. Quantized modules
        come already converted (quantization.convert_checkpoint): their parts fuse along N.
        With tensor parallelism each tensor is cut to this rank's slice first (tp_layers.shard)."""
        params = dict(self.named_parameters())
        cfg = self.cfg
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_rows = {"q": (0, h * d), "k": (h * d, hkv * d), "v": ((h + hkv) * d, hkv * d)}
        loaded: set[str] = set()
        if cfg.norm_weightless:  # NanoChat's RMSNorms have no weights: ones, none to read
            for name, p in params.items():
                if name.endswith("norm.weight"):
                    p.data.fill_(1.0)
                    loaded.add(name)
        ignored = _ignored_on_load(cfg.hf_config)  # e.g. GLM-4.5's and ERNIE's MTP layers
        skipped = 0
        if cfg.multimodal:  # the language model's tensors, under its own names
            weights = ((n, t) for name, t in weights
                       if (n := text_weight_name(name)) is not None)
        if cfg.model_type in _FAMILY_NAMES:
            weights = _renamed(weights, _FAMILY_NAMES[cfg.model_type])
        for raw, tensor in _unfused(weights, cfg):
            name = raw.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.") \
                .replace(".mlp.shared_experts.", ".mlp.shared_expert.") \
                .replace(".mlp.router.", ".mlp.gate.")  # GLM-4.5's, ERNIE's; gpt-oss's
            if name.endswith(".mlp.moe_statics.e_score_correction_bias"):  # ERNIE's [1, E]
                name = name.replace(".moe_statics.", ".gate.")
                tensor = tensor.reshape(-1)
            elif name.endswith(".mlp.e_score_correction_bias"):  # MiniMax-M2's, on the block
                name = name.replace(".mlp.", ".mlp.gate.")
            if "rotary_emb" in name or self._load_kv_scale(name, tensor):
                continue
            if ignored is not None and ignored.search(raw) and self._unexpected(name, params):
                skipped += 1  # as HF skips them: not part of the decoder it runs
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if ".experts." in name:
                loaded.update(self._load_experts(params, name, tensor))
                continue
            if cfg.model_type == "glm4":  # its four norms under the sandwich's names
                name = _GLM4_NORMS.sub(lambda m: _GLM4_RENAMED[m.group(1)], name)
            if cfg.norm_offset and name.endswith("norm.weight"):  # stored as (1 + w)
                tensor = tensor.float() + cfg.norm_offset
            if (cfg.rotary_dim or cfg.rotary_interleaved) and _ROTATED.search(name):
                tensor = _rotary_permuted(name, tensor, cfg)
            if cfg.latent is not None and cfg.latent.interleaved:
                tensor = _latent_rope_permuted(name, tensor, cfg)
            shared = ".shared_expert." in name
            target, rows = name, None
            for part, (start, size) in qkv_rows.items():
                if f"self_attn.{part}_proj." in name and cfg.latent is None:
                    target = name.replace(f"{part}_proj", "qkv_proj")
                    rows = (start, size)
            inter = cfg.moe.shared_intermediate_size if shared else cfg.intermediate_size
            for i, part in enumerate(("gate", "up")):  # (an ungated MLP's up_proj stays)
                if (f"mlp.{part}_proj." in name and cfg.mlp_gated
                        or f"shared_expert.{part}_proj." in name):
                    target, rows = name.replace(f"{part}_proj", "gate_up_proj"), (i * inter, inter)
            if target not in params:
                if name.endswith(".bias") and not tensor.any():
                    continue  # GPTQ writers add zero biases to bias-free layers
                raise KeyError(f"unexpected weight {name}")
            dst = params[target].data
            tensor = self._shard(name, tensor, shared)
            if name.rpartition(".")[0].endswith(("embed_tokens", "lm_head")) \
                    and dst.shape[0] > tensor.shape[0]:  # the last rank's vocabulary: padded
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
            _copy(name, dst, tensor)
            loaded.add(target if rows is None else f"{target}[{rows[0]}]")
        experts = cfg.moe.num_experts if cfg.moe else 0
        expected = sum(3 if ".qkv_proj." in n else 2 if "gate_up" in n
                       else 2 * experts if n.endswith(".w13") else experts if n.endswith(".w2")
                       else 0 if n.endswith(("w13_scale", "w2_scale"))  # filled with codes
                       else 1 for n in params)
        if len(loaded) != expected:
            raise ValueError(f"checkpoint filled {len(loaded)} of {expected} weight tensors")
        if skipped:
            log.info("%d checkpoint tensors skipped as HF skips them (%s)", skipped,
                     ignored.pattern)

    def _unexpected(self, name: str, params: dict) -> bool:
        """Whether a checkpoint tensor is not the decoder's: of a layer past num_layers (a
        multi-token-prediction layer), or outside the layers and not a parameter."""
        m = re.match(r"layers\.(\d+)\.", name)
        return int(m.group(1)) >= self.cfg.num_layers if m else name not in params

    def _shard(self, name: str, tensor: torch.Tensor, shared: bool) -> torch.Tensor:
        """This rank's slice of a non-expert tensor: tp_layers.shard, but for the shared
        expert (its own width) and a norm over the whole q or k projection (its heads)."""
        cfg = self.cfg
        if cfg.tp_size == 1:
            return tensor
        if shared:  # its own width, cut as any MLP's (float, FP8 or 4-bit parts)
            return tp.shard(name, tensor, cfg, self.quant, cfg.moe.shared_intermediate_size)
        if cfg.latent is not None and ".self_attn." in name:
            return _latent_shard(name, tensor, cfg)
        if name.endswith("self_attn.sinks"):  # one per query head: this rank's heads
            return tensor.narrow(0, cfg.head_start, cfg.num_heads)
        if cfg.qk_norm == "full" and name.endswith(("q_norm.weight", "k_norm.weight")):
            d = cfg.head_dim
            if name.endswith("q_norm.weight"):
                return tensor.narrow(0, cfg.head_start * d, cfg.num_heads * d)
            return tensor.narrow(0, cfg.kv_head_start * d, cfg.num_kv_heads * d)
        return tp.shard(name, tensor, cfg, self.quant)

    def _load_experts(self, params: dict[str, nn.Parameter], name: str,
                      tensor: torch.Tensor) -> list[str]:
        """Copies one expert's gate, up or down (as hub checkpoints hold them) or every
        expert's stacked gate_up / down (transformers 5's own layout) into w13 / w2; returns
        the parts filled."""
        cfg, moe = self.cfg, self.cfg.moe
        if moe is None:
            raise KeyError(f"unexpected weight {name}")
        if tensor.dtype == FP8 or name.endswith("_scale") or name.endswith("_scale_inv"):
            raise QuantizationError(f"{name}: FP8 experts are read as one e4m3 weight and "
                                    f"its weight_scale per expert projection (experts.N.*), "
                                    f"not in this layout")
        width, start = moe.intermediate_size, self.cfg.tp_rank * moe.intermediate_size
        if cfg.model_type == "gpt_oss":
            return self._load_gpt_oss_experts(name, tensor)
        m = _EXPERT.match(name)
        if m is not None:
            layer, e, part = m.group(1), int(m.group(2)), m.group(3)
            experts, tensor = [e], tensor[None]
            kind = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(part,
                                                                                       "down")
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            layer = name.split(".mlp.")[0] + "."
            experts = list(range(moe.num_experts))
            kind = "gate_up" if name.endswith("gate_up_proj") else "down"
        else:
            raise KeyError(f"unexpected weight {name}")
        if f"{layer}mlp.w13" not in params:
            raise KeyError(f"unexpected weight {name}: layer {layer[:-1]} has no experts")
        block = self.layers[int(layer.split(".")[1])].mlp
        whole = moe.intermediate_size * cfg.tp_size
        filled = []
        for i, e in enumerate(experts):
            if kind == "down":  # [hidden, I]: this rank's columns
                block.place("w2", e, None, tensor[i].narrow(1, start, width))
                filled.append(f"{layer}mlp.w2[{e}]")
                continue
            parts = {"gate": [(0, 0)], "up": [(0, width)],
                     "gate_up": [(0, 0), (whole, width)]}[kind]
            for src_off, dst_off in parts:  # [I, hidden] rows: this rank's slice
                block.place("w13", e, (dst_off, width), tensor[i].narrow(0, src_off + start,
                                                                          width))
                filled.append(f"{layer}mlp.w13[{e},{dst_off}]")
        return filled

    def _load_gpt_oss_experts(self, name: str, tensor: torch.Tensor) -> list[str]:
        """gpt-oss's stacked experts as HF holds them: gate_up_proj [E, hidden, 2I] with gate
        and up in alternate columns, down_proj [E, I, hidden], and their biases [E, 2I] (the
        same alternation) and [E, hidden]; an MXFP4 checkpoint's arrive so too
        (quantization/mxfp4.py)."""
        cfg, moe = self.cfg, self.cfg.moe
        layer, _, kind = name.partition(".mlp.experts.")
        if kind not in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            raise KeyError(f"unexpected weight {name}")
        block = self.layers[int(layer.split(".")[1])].mlp
        width, start = moe.intermediate_size, cfg.tp_rank * moe.intermediate_size
        if tensor.shape[0] != moe.num_experts:
            raise ValueError(f"{name}: {tensor.shape[0]} experts, the config says "
                             f"{moe.num_experts}")
        if kind == "down_proj_bias":  # added once: by rank 0 (the all_reduce sums the ranks)
            _copy(name, block.w2_bias.data, tensor if cfg.tp_rank == 0 else tensor * 0)
            return [f"{layer}.mlp.w2_bias"]
        if kind == "gate_up_proj_bias":
            for half, dst in ((0, 0), (1, width)):  # gate columns even, up columns odd
                _copy(name, block.w13_bias.data[:, dst:dst + width],
                      tensor[:, half::2][:, start:start + width])
            return [f"{layer}.mlp.w13_bias"]
        filled = []
        for e in range(moe.num_experts):
            w = tensor[e].t()  # nn.Linear's [out, in]
            if kind == "down_proj":
                block.place("w2", e, None, w.narrow(1, start, width))
                filled.append(f"{layer}.mlp.w2[{e}]")
                continue
            for half, dst in ((0, 0), (1, width)):
                block.place("w13", e, (dst, width), w[half::2].narrow(0, start, width))
                filled.append(f"{layer}.mlp.w13[{e},{dst}]")
        return filled


_GLM4_RENAMED = {"post_self_attn_layernorm": ".post_attention_layernorm.",
                 "post_attention_layernorm": ".pre_feedforward_layernorm.",
                 "post_mlp_layernorm": ".post_feedforward_layernorm."}
_GLM4_NORMS = re.compile(r"\.(post_self_attn_layernorm|post_attention_layernorm|"
                         r"post_mlp_layernorm)\.")
_ROTATED = re.compile(r"self_attn\.(?:q_proj|k_proj|q_norm|k_norm)\.")


def _rotary_permuted(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A q or k projection's (or norm's) checkpoint tensor with each head in
    layers.rotary_order, along its output dimension (a 4-bit part's dim 1; a fused qkv is
    split first, _unfused). Per-tensor scales and act-order's input permutation pass."""
    if name.endswith((".perm", ".input_scale")) or tensor.numel() == 1:
        return tensor
    return permute_heads(tensor, 1 if name.endswith(_PACKED_ALONG_N) else 0, cfg)


def _latent_rope_permuted(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Latent attention's rope rows (each head's last `rope` rows of q, the last `rope` of
    kv_a_proj_with_mqa) from HF's interleaved pairs (2i, 2i + 1; DeepSeek V3's
    rope_interleave) to the rotation's halves (i, i + rope / 2): q . k is the same under one
    permutation of both, and the rotation is then the one every family runs."""
    lat = cfg.latent
    order = torch.cat([torch.arange(0, lat.rope, 2), torch.arange(1, lat.rope, 2)])
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight",
                      "self_attn.q_proj.weight_scale")):  # (FP8 at load: a scale a row)
        heads = tensor.reshape(-1, lat.nope + lat.rope, *tensor.shape[1:])
        rope = heads[:, lat.nope:][:, order]
        return torch.cat([heads[:, :lat.nope], rope], dim=1).reshape(tensor.shape)
    if name.endswith(("self_attn.kv_a_proj_with_mqa.weight",
                      "self_attn.kv_a_proj_with_mqa.bias")):
        r = lat.kv_lora_rank
        return torch.cat([tensor[:r], tensor[r:][order]])
    return tensor


def _latent_shard(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """This rank's part of a latent-attention tensor: its heads' rows of q and kv_b_proj,
    its heads' columns of o_proj (o_proj's bias added by rank 0 alone); the latent's own
    projections and norms whole."""
    lat, start, n = cfg.latent, cfg.head_start, cfg.num_heads
    module = name.rpartition(".")[0]
    if module.endswith(("self_attn.q_proj", "self_attn.q_b_proj")):
        return tensor.narrow(0, start * (lat.nope + lat.rope), n * (lat.nope + lat.rope))
    if module.endswith("self_attn.kv_b_proj"):
        return tensor.narrow(0, start * (lat.nope + lat.v), n * (lat.nope + lat.v))
    if name.endswith("self_attn.o_proj.weight"):
        return tensor.narrow(1, start * lat.v, n * lat.v)
    if name.endswith("self_attn.o_proj.bias"):
        return tensor if cfg.tp_rank == 0 else torch.zeros_like(tensor)
    return tensor


def _ignored_on_load(hf_config) -> re.Pattern | None:
    """What HF's own causal LM for this config skips in a checkpoint
    (`_keys_to_ignore_on_load_unexpected`: the multi-token-prediction layers GLM-4.5 keeps as
    `model.layers.46`, ERNIE 4.5's `mtp` blocks), as one pattern; None where it skips
    nothing."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        return None
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


# a family's own tensor names -> the decoder's: GraniteMoE's stacked experts, router and
# shared MLP (transformers 5's conversion mapping renames the first three), Hunyuan's q/k norms
# and router, HY V3's and AFMoE's routers and choice biases; AFMoE's, VaultGemma's and
# HyperCLOVAX's norms under the decoder's names for their places
_GRANITE_MOE = (("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"),
                ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"),
                ("block_sparse_moe.router.layer.weight", "mlp.gate.weight"),
                ("shared_mlp.input_linear.", "mlp.shared_expert.gate_up_proj."),
                ("shared_mlp.output_linear.", "mlp.shared_expert.down_proj."))
_HUNYUAN = ((".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm."))
_ROUTER_GATE = ((".mlp.router.gate.", ".mlp.gate."),  # HY V3's and AFMoE's router and bias
                (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))
_FAMILY_NAMES = {"vaultgemma": ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),),
                 "nanochat": ((".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj.")),
                 "apertus": ((".attention_layernorm.", ".input_layernorm."),
                             (".feedforward_layernorm.", ".post_attention_layernorm.")),
                 # HyperCLOVAX's peri-LN: its MLP's pre-norm first, then the others' places
                 "hyperclovax": ((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
                                 (".post_norm1.", ".post_attention_layernorm."),
                                 (".post_norm2.", ".post_feedforward_layernorm.")),
                 "granitemoe": _GRANITE_MOE, "granitemoeshared": _GRANITE_MOE,
                 "granitemoe_swa": _GRANITE_MOE,
                 "hunyuan_v1_dense": _HUNYUAN,
                 "hunyuan_v1_moe": (*_HUNYUAN, (".mlp.gate.wg.", ".mlp.gate."),
                                    (".mlp.shared_mlp.", ".mlp.shared_expert.")),
                 "hy_v3": (*_ROUTER_GATE, (".mlp.shared_mlp.", ".mlp.shared_expert.")),
                 "afmoe": (*_ROUTER_GATE, (".pre_mlp_layernorm.", ".pre_feedforward_layernorm."),
                           (".post_mlp_layernorm.", ".post_feedforward_layernorm."))}


def _renamed(weights: Iterable[tuple[str, torch.Tensor]], pairs: tuple[tuple[str, str], ...]
             ) -> Iterable[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in pairs:
            name = name.replace(old, new)
        yield name, tensor


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


def _unfused(weights: Iterable[tuple[str, torch.Tensor]],
             cfg: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's fused qkv_proj and gate_up_proj (Phi-3) as the q/k/v and gate/up parts
    other checkpoints hold, so that sharding and fusing treat every family alike: float and
    FP8 weights, biases and per-channel scales split along their rows, 4-bit parts (in the
    kernels' layout) along their columns; what a fused projection shares (a per-tensor scale,
    act-order's input permutation) goes to each part."""
    c = cfg.hf_config
    d = cfg.head_dim
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        fused = ("qkv_proj" if module.endswith("self_attn.qkv_proj") else "gate_up_proj"
                 if module.endswith(("mlp.gate_up_proj", "shared_expert.gate_up_proj"))
                 and ".experts." not in name else "")
        if not fused:
            yield name, tensor
            continue
        parts = ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj",
                                                                              "up_proj")
        names = [name.replace(fused, p) for p in parts]
        if kind in ("perm", "input_scale") or tensor.numel() == 1:
            yield from ((n, tensor) for n in names)
            continue
        dim = 1 if name.endswith(_PACKED_ALONG_N) else 0
        sizes = [heads * d, kv * d, kv * d] if fused == "qkv_proj" \
            else [tensor.shape[dim] // 2] * 2
        yield from zip(names, tensor.split(sizes, dim=dim), strict=True)
