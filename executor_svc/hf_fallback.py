"""The transformers fallback (--model-impl transformers, or auto for a model_type with no
native module): HF transformers' own modeling code runs the model, with pagedserve's paged
attention plugged in through transformers' attention interface, so that scheduling, prefix
caching, preemption, sampling and the APIs work unchanged.

The flattened batch of T tokens goes in as one sequence [1, T] with its positions; each
attention module's call lands in `paged_attention_forward`, which writes the step's K and V
into the paged cache at the plan's slots and attends over each sequence's blocks. The
implementation is registered under a name transformers has no mask function for, so it builds
no attention mask. Native modules stay the fast path (no fused kernels or CUDA graphs here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.layers import AttentionMetadata, Ops

IMPLEMENTATION = "pagedserve_paged"


@dataclass
class _Step:
    """What the attention calls of one forward pass read: set by TransformersLM.hidden."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    meta: AttentionMetadata | None = None
    ops: Ops = None


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key and value [1, Hkv, T, D]
    (after RoPE); returns [1, T, H, D]."""
    step: _Step = module.pagedserve_step
    meta = step.meta
    k_cache, v_cache = step.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    step.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, 1.0, 1.0)
    options = {}
    window = kwargs.get("sliding_window") or 0
    if window:
        options["sliding_window"] = int(window)
    if kwargs.get("softcap"):
        options["logits_soft_cap"] = float(kwargs["softcap"])
    o = step.ops.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        scaling if scaling is not None else q.shape[-1] ** -0.5,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, **options)
    return o[None], None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention_forward)


class TransformersLM(nn.Module):
    """The executor's model interface (hidden, logits, logits_of) over an HF causal LM."""

    def __init__(self, cfg: ModelConfig, hf: nn.Module, ops: Ops) -> None:
        super().__init__()
        self.cfg, self.hf, self.quant = cfg, hf, None
        self.step = _Step(ops=ops)
        attn = [m for m in hf.modules()
                if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
        layers = {m.layer_idx for m in attn}
        if layers != set(range(cfg.num_layers)):
            raise ValueError(f"{cfg.model_type}: found attention modules for layers "
                             f"{sorted(layers)}, expected 0..{cfg.num_layers - 1}")
        for m in attn:
            m.pagedserve_step = self.step

    @classmethod
    def build(cls, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device,
              weights_dir: Path | None, seed: int = 0) -> TransformersLM:
        from transformers import AutoModelForCausalLM

        if cfg.tp_size > 1:
            raise ValueError("the transformers fallback runs on one rank: "
                             "--tensor-parallel-size 1")
        register()
        cfg.hf_config._attn_implementation = IMPLEMENTATION
        if weights_dir is None:
            torch.manual_seed(seed)
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(cfg.hf_config, dtype=dtype,
                                                      attn_implementation=IMPLEMENTATION)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=dtype,
                                                      attn_implementation=IMPLEMENTATION)
        return cls(cfg, hf.to(device).eval(), ops)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, out=None):
        logits = self.logits(self.hidden(input_ids, positions, kv_caches, meta)[logits_indices])
        return logits if out is None else out.copy_(logits)

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        self.step.kv_caches, self.step.meta = kv_caches, meta
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                 use_cache=False)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] fp32
        """The LM head and the scalings HF's causal LMs apply after it."""
        c = self.cfg.hf_config
        logits = self.hf.get_output_embeddings()(hidden).float()
        if getattr(c, "logits_scaling", None):  # Granite
            logits = logits / c.logits_scaling
        if getattr(c, "logit_scale", None):  # Cohere
            logits = logits * c.logit_scale
        cap = getattr(c, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden[rows])

    def kv_scales_summary(self) -> str:
        return "the transformers fallback keeps no FP8 KV scales: 1.0"
