"""Model and engine configuration of the executor, frozen once at start."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagedserve.executor.families import (
    SUPPORTED,
    Latent,
    Moe,
    UnsupportedModelError,
    family_fields,
    text_config_of,
)

log = logging.getLogger("pagedserve.executor")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The parts of an HF config.json the decoder needs; the family switches (qk_norm ..
    moe) are families.family_fields'."""

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
    o_proj_bias: bool = False  # a bias on o_proj (Llama's attention_bias, Seed-OSS's own)
    # "": none, "head": RMSNorm over each head, "full": over the projection, "head_after_rope":
    # over each head once rotated (Hunyuan)
    qk_norm: str = ""
    # "pre" (Llama), "post" (OLMo 2), "sandwich" (Gemma: pre and post), "parallel" (Cohere:
    # attention and MLP read one norm's output, their sum joins the residual)
    norm_style: str = "pre"
    norm_offset: float = 0.0  # 1.0: norms scale by (1 + w) (Gemma)
    norm_type: str = "rms"  # "rms", or "layer": mean-centred LayerNorm (Cohere, StableLM)
    norm_bias: bool = False  # the LayerNorms have a bias (StableLM)
    hidden_act: str = "silu"  # "silu" (SwiGLU), "gelu_tanh" (GeGLU); ungated "relu2", "xielu"
    mlp_gated: bool = True  # False: the dense MLP is down(act(up(x))) (Jais 2's relu2)
    mlp_bias: bool = False  # biases on the dense MLP's projections (Llama's, Granite's mlp_bias)
    lm_head_bias: bool = False  # a bias on the LM head (Phi-3.5-MoE's lm_head_bias)
    # NanoChat: RMSNorms without weights (ones, nothing in the checkpoint), the final norm also
    # right after the embeddings, and RoPE turning the other way (its rotate_half's signs)
    norm_weightless: bool = False
    embed_norm: bool = False
    rope_reversed: bool = False
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite's multiplier)
    embed_scale_in_dtype: bool = False  # the scale rounded to the weights' dtype first (Gemma)
    residual_scale: float = 1.0  # each sublayer's output times this before the residual add
    logit_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    attn_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # cap * tanh(score / cap) before the softmax; 0: off
    final_softcap: float = 0.0  # the same on the logits
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 full
    local_rope: bool = False  # windowed layers use the config's sliding_attention RoPE
    rope_layers: tuple[bool, ...] = ()  # per layer: rotated (SmolLM3's NoPE layers: False); ()
    # per layer: its RoPE base (Granite SWA's layer_rope_theta; 0 where rope_layers says none);
    # (): every layer the config's
    layer_rope_theta: tuple[float, ...] = ()
    # partial rotary embeddings (Phi-4-mini): the first rotary_dim of each q and k head rotate,
    # the rest pass; 0: all. Served by a permutation of each head (layers.rotary_order)
    rotary_dim: int = 0
    rotary_interleaved: bool = False  # rotated pairs are (2i, 2i + 1) (GLM), not (i, i + d/2)
    moe: Moe | None = None
    # multi-head latent attention (DeepSeek V3): the KV cache holds one "KV head" of the
    # latent and the rope part (head_dim = kv_lora_rank + rope, num_kv_heads 1), keys and
    # values in one tensor (kv_bytes_per_token counts it once)
    latent: Latent | None = None
    attn_sinks: bool = False  # a learned logit per query head in each softmax (gpt-oss,
    # Granite SWA)
    attn_output_gate: bool = False  # attention's output times sigmoid(gate_proj(x)) (AFMoE)
    # Ministral 3's query scale by position, Llama 4's: 1 + beta * log(1 + floor(pos / orig))
    # as (beta, orig); (): none
    q_position_scale: tuple[float, int] = ()
    impl: str = "native"  # "native" (model.py) or "transformers" (hf_fallback.py)
    # the fallback's longest exact context where the model attends in chunks (Llama 4's
    # attention_chunk_size: its mask, which the paged attention does not apply); 0: none
    exact_len: int = 0
    multimodal: str = ""  # a vision-language checkpoint served text-only: its model_type
    # Tensor parallelism (executor_svc/tp_layers.py): a rank's config counts its own share of
    # the heads, KV heads and MLP width; hidden_size and vocab_size stay whole.
    tp_rank: int = 0
    tp_size: int = 1
    kv_head_start: int = 0  # the first of this rank's KV heads in the checkpoint
    head_start: int = 0  # the first of this rank's query heads

    @classmethod
    def from_pretrained(cls, path: str | Path, impl: str = "native") -> ModelConfig:
        """impl: "native" (a native module or an error naming the supported families),
        "transformers" (HF's modeling code, hf_fallback.py), "auto" (native where one is and
        takes the config's switches: Phi-4-mini's partial rotary embeddings go to the
        fallback)."""
        c = hf_config(path)
        if impl not in ("auto", "native", "transformers"):
            raise ValueError(f"model impl must be auto, native or transformers, got {impl!r}")
        text, wrapper = text_config_of(c)
        if impl == "transformers" or (impl == "auto" and text.model_type not in SUPPORTED):
            return cls.for_transformers(c)
        try:
            cfg = cls.from_hf(text)
        except UnsupportedModelError as native:  # a switch the native module lacks
            if impl == "native":
                raise
            try:
                fallback = cls.for_transformers(c)
            except UnsupportedModelError:
                raise native from None
            log.warning("%s natively; serving it through transformers' modeling code (the "
                        "transformers fallback: slower, one rank)", native)
            return fallback
        if not wrapper:
            return cfg
        # HF ties a wrapper's output embedding by the wrapper's flag (Mistral3Config's default
        # is True where its text_config says False); a checkpoint that saved its own head
        # (Mistral Small 3.1) keeps it
        tie = cfg.tie_word_embeddings or (bool(getattr(c, "tie_word_embeddings", False))
                                          and not _saves_lm_head(Path(path)))
        return replace(cfg, multimodal=wrapper, tie_word_embeddings=tie)

    @classmethod
    def for_transformers(cls, c: Any) -> ModelConfig:
        """The decoder's dimensions as the KV cache and scheduler need them, for a model run by
        HF's own modeling code (hf_fallback.py)."""
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        if type(c) not in MODEL_FOR_CAUSAL_LM_MAPPING and not _register_causal_lm(c):
            raise UnsupportedModelError(f"unsupported model_type {c.model_type!r}: no native "
                                        f"module (supported are {', '.join(SUPPORTED)}) and "
                                        f"transformers has no causal LM for it")
        t = c.get_text_config()  # a vision-language wrapper's sizes are its language model's
        try:
            heads = t.num_attention_heads
            kv_heads = getattr(t, "num_key_value_heads", None) or heads
            head_dim = getattr(t, "head_dim", None) or t.hidden_size // heads
        except Exception as e:  # noqa: BLE001 - e.g. Gemma 4's per-layer head sizes
            raise UnsupportedModelError(
                f"{c.model_type}: the transformers fallback needs one head size and KV-head "
                f"count for every layer (the KV cache's), and the config gives none "
                f"({type(e).__name__}: {str(e).splitlines()[0]})") from e
        chunk = int(getattr(t, "attention_chunk_size", None) or 0)
        if getattr(t, "kv_lora_rank", None) and getattr(t, "qk_nope_head_dim", None):
            # multi-head latent attention as HF runs it (DeepSeek V2/V3, Kimi, MiniCPM3):
            # each head's key (no-RoPE and RoPE parts) and value expanded from the latent;
            # the cache holds both per head, values padded to the key's size (hf_fallback)
            kv_heads = heads
            head_dim = max(t.qk_nope_head_dim + t.qk_rope_head_dim, t.v_head_dim)
        return cls(
            exact_len=chunk,
            model_type=c.model_type, hidden_size=t.hidden_size, num_layers=t.num_hidden_layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=getattr(t, "intermediate_size", 0) or 0, vocab_size=t.vocab_size,
            rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(getattr(t, "tie_word_embeddings", False)),
            max_position_embeddings=min(t.max_position_embeddings, chunk or 1 << 62),
            attention_bias=False, hf_config=c, impl="transformers")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        from transformers import AutoConfig

        d = dict(d)
        return cls.from_hf(AutoConfig.for_model(d.pop("model_type", "llama"), **d))

    @classmethod
    def from_hf(cls, c: Any) -> ModelConfig:
        family = family_fields(c)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        if family["latent"] is not None:  # the cache's one head: the latent and rope part
            head_dim, kv_heads = family["latent"].kv_lora_rank + family["latent"].rope, 1
        return cls(
            model_type=c.model_type,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            rms_norm_eps=(getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", None)
                          or c.norm_eps),  # (Nemotron's name)
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            max_position_embeddings=c.max_position_embeddings,
            hf_config=c,
            **family,
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
        moe = self.moe
        if moe is not None:  # experts split along their width, as dense MLPs are
            widths = (moe.intermediate_size, moe.shared_intermediate_size)
            if any(w % size for w in widths):
                raise ValueError(f"expert widths {widths} are not divisible by tensor parallel "
                                 f"size {size}")
            moe = replace(moe, intermediate_size=widths[0] // size,
                          shared_intermediate_size=widths[1] // size)
        return replace(self, num_heads=q_n, num_kv_heads=kv_n, intermediate_size=inter // size,
                       tp_rank=rank, tp_size=size, kv_head_start=kv_start, head_start=q_start,
                       moe=moe)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        parts = 1 if self.latent is not None else 2  # a latent is its own value
        return parts * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def hf_config(path: str | Path) -> Any:
    """The checkpoint's transformers config. Remote code never runs (a checkpoint's own
    Python is not loaded): a config.json whose model_type transformers lacks but whose
    `architectures` names a causal LM transformers has (Kimi K2's kimi_k2 names
    DeepseekV3ForCausalLM, as vLLM reads it) is read as that class's config."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except ValueError:
        c = _config_of_architecture(Path(path))
        if c is None:
            raise
        return c


def _config_of_architecture(path: Path) -> Any:
    import json

    import transformers

    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for name in d.get("architectures") or ():
        config_class = getattr(getattr(transformers, name, None), "config_class", None)
        if name.endswith("ForCausalLM") and config_class is not None:
            log.warning("%s: model_type %r is not in transformers; read as %s's config (%s)",
                        path, d.get("model_type"), name, config_class.model_type)
            fields = {k: v for k, v in d.items() if k not in ("model_type", "auto_map")}
            return config_class.from_dict(fields)
    return None


def _register_causal_lm(c: Any) -> bool:
    """Register the causal LM a config's `architectures` names (a transformers class ending in
    ForCausalLM) where transformers' auto mapping lacks it (Mistral 4 in transformers 5.25);
    whether one was."""
    import transformers
    from transformers import AutoModelForCausalLM

    for name in getattr(c, "architectures", None) or ():
        model = getattr(transformers, name, None) if name.endswith("ForCausalLM") else None
        if model is not None and getattr(model, "config_class", None) is type(c):
            AutoModelForCausalLM.register(type(c), model, exist_ok=True)
            return True
    return False


def balanced(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, count) of part i when n items split into `parts` contiguous runs whose sizes
    differ by at most one, the longer runs first."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (i < extra)


def _saves_lm_head(path: Path) -> bool:
    """Whether the checkpoint in `path` holds an lm_head (of any prefix)."""
    from pagedserve.executor.checkpoint import CheckpointFilesError, checkpoint_names

    try:
        names = checkpoint_names(path)
    except CheckpointFilesError:
        return False  # the loader says so, with the folder's name
    return any(n.endswith("lm_head.weight") for n in names)
