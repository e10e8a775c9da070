"""Model and engine configuration of the executor, frozen once at start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The parts of an HF config.json a Llama-family model needs (Llama, Mistral, Qwen2, SmolLM)."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool
    hf_config: Any  # the transformers config object, for rope scaling functions

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        return cls.from_hf(AutoConfig.from_pretrained(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        from transformers import AutoConfig

        d = dict(d)
        return cls.from_hf(AutoConfig.for_model(d.pop("model_type", "llama"), **d))

    @classmethod
    def from_hf(cls, c: Any) -> ModelConfig:
        if c.model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {c.model_type!r} (llama, mistral, qwen2)")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            model_type=c.model_type,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            max_position_embeddings=c.max_position_embeddings,
            attention_bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")),
            hf_config=c,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

