"""Model and engine configuration of the executor, frozen once at start."""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    # Tensor parallelism (executor_svc/tp_layers.py): a rank's config counts its own share of
    # the heads, KV heads and MLP width; hidden_size and vocab_size stay whole.
    tp_rank: int = 0
    tp_size: int = 1
    kv_head_start: int = 0  # the first of this rank's KV heads in the checkpoint
    head_start: int = 0  # the first of this rank's query heads

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

    def for_rank(self, rank: int, size: int) -> ModelConfig:
        """This rank's share under Megatron-style tensor parallelism over `size` ranks: KV heads
        in contiguous runs as even as the count allows (fewer KV heads than ranks: each rank
        holds a copy of one), each with its query heads; the MLP width split evenly.
        Raises ValueError for a split that cannot be made."""
        if size == 1:
            return self
        h, hkv, inter = self.num_heads, self.num_kv_heads, self.intermediate_size
        if inter % size:
            raise ValueError(f"intermediate_size {inter} is not divisible by tensor parallel "
                             f"size {size}")
        group = h // hkv  # query heads per KV head
        if hkv >= size:
            kv_start, kv_n = balanced(hkv, size, rank)
            q_start, q_n = kv_start * group, kv_n * group
        else:
            if size % hkv or h % size:
                raise ValueError(f"{hkv} KV heads / {h} heads cannot be split over {size} ranks "
                                 f"(with fewer KV heads than ranks, the ranks must be a multiple "
                                 f"of the KV heads and divide the heads)")
            kv_start, kv_n = rank * hkv // size, 1
            q_start, q_n = rank * (h // size), h // size
        return replace(self, num_heads=q_n, num_kv_heads=kv_n, intermediate_size=inter // size,
                       tp_rank=rank, tp_size=size, kv_head_start=kv_start, head_start=q_start)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes



def balanced(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, count) of part i when n items split into `parts` contiguous runs whose sizes
    differ by at most one, the longer runs first."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (i < extra)
