"""What each supported model family changes in the shared decoder, read from its HF config.

One decoder (model.py) serves every family; a family is the set of switches below. The loader
maps each checkpoint's tensor names onto the decoder's (model.load_weights).

    family        norms                 attention                      MLP
    llama etc.    pre-norm              GQA, RoPE (any scaling)        SwiGLU
    ministral     as mistral            windows by layer_types         SwiGLU
    ministral3    as mistral            q scaled by position (Llama 4) SwiGLU
    cwm           as llama              windows by layer_types         SwiGLU
    apertus       as llama              q/k norm per head              down(xielu(up(x)))
    arcee         as llama              as llama                       down(relu(up(x))^2)
    nanochat      weightless RMSNorms,  RoPE turned the other way,     down(relu(up(x))^2)
                  also after embedding  q/k norm per head after it
    granite       pre-norm, sublayer    scale attention_multiplier     SwiGLU; embeddings and
                  outputs scaled                                       logits scaled
    hyperclovax   sandwich (peri-LN)    as granite; logits times       SwiGLU
                                        logits_scaling
    smollm3       pre-norm              no RoPE on no_rope_layers' 0s  SwiGLU
    qwen3         pre-norm              + RMSNorm of q, k per head     SwiGLU
    olmo2         post-norm             + RMSNorm of the whole q, k    SwiGLU
    exaone4       post-norm             q/k norm per head, windows,    SwiGLU
                                        no RoPE on global layers
    cohere(2)     one LayerNorm,        RoPE in (2i, 2i + 1) pairs;    SwiGLU beside attention;
                  parallel blocks       cohere2: windows, global NoPE  logits scaled
    stablelm      LayerNorms (bias)     partial RoPE, qkv bias         SwiGLU (parallel if set)
    jais2         pre-LayerNorm (bias)  biases                         down(relu(up(x))^2), biases
    nemotron      pre-LayerNorm (1 + w, as stablelm (partial rotary)   down(relu(up(x))^2)
                  bias)                 with biases
    gemma         pre-norm, (1 + w)     GQA, RoPE                      GeGLU (tanh)
    gemma2        pre+post, (1 + w)     soft-capped logits, windows    GeGLU (tanh)
    vaultgemma    pre-norm, (1 + w)     as gemma2                      GeGLU (tanh)
    gemma3_text   pre+post, (1 + w)     q/k norm, windows, 2 RoPEs     GeGLU (tanh)
    phi3          pre-norm              fused qkv, LongRoPE            fused gate_up SwiGLU
    glm, glm4     pre(+post: glm4)      qkv bias, half rotary (pairs)  fused gate_up SwiGLU
    mixtral       pre-norm              GQA (window if set)            top-k experts
    phimoe        pre-LayerNorm (bias)  biases (o too), LongRoPE       mixtral's experts, routed by
                                                                       the sparsemixer (top 2)
    qwen2_moe     pre-norm              qkv bias                       top-k experts + gated shared
    qwen3_moe     pre-norm              q/k norm per head              top-k experts (normalized)
    mellum        pre-norm              as qwen3_moe, windows with     qwen3_moe's experts; dense
                                        their own RoPE base (Gemma 3)  layers by mlp_layer_types
    olmoe         pre-norm              + RMSNorm of the whole q, k    top-k experts
    flex_olmo     post-norm             as olmo2                       top-k experts (olmoe's)
    exaone_moe    pre-norm              as exaone4                     as glm4_moe's
    granitemoe(shared) as granite                                      top-k experts (+ shared)
    granite_swa, granitemoe_swa  as granite, a sink logit per head,  as granite(moe)
                                        windows, a RoPE base per layer
    hunyuan_v1_dense  pre-norm          RMSNorm of each q, k head      SwiGLU
                                        after RoPE; NTK-alpha RoPE
    hunyuan_v1_moe    pre-norm          as hunyuan_v1_dense            top-k experts (float32
                                                                       router) + shared MLP
    glm4_moe      pre-norm              half rotary, qkv bias, q/k     sigmoid-routed experts in
                                        norm per head when set         groups + shared expert
    dots1         pre-norm              q/k norm per head              as glm4_moe's
    solar_open    pre-norm              as llama                       as glm4_moe's, every layer
    hy_v3         pre-norm              as qwen3                       sigmoid-routed experts with
                                                                       a choice bias + shared
    afmoe         sandwich              q/k norm per head, windows,    as hy_v3's; dense first
                                        RoPE on windowed layers only,  layers
                                        output gated by sigmoid(g(x))
    ernie4_5_moe  pre-norm              RoPE in (2i, 2i + 1) pairs     softmax-routed experts with
                                                                       a choice bias + shared
    gpt_oss       pre-norm              biases, a sink logit per head, biased router and experts,
                                        windows on alternate layers    clamped SwiGLU (alpha)
    minimax_m2    pre-norm              RMSNorm of the whole q, k;     sigmoid-routed experts with
                                        half of each head rotated      a choice bias (no groups)
    deepseek_v3   pre-norm              latent (MLA): one cached       as glm4_moe's; dense first
                                        latent per token, absorbed     layers
    deepseek_v2   pre-norm              as deepseek_v3 (pairs          softmax top k (in groups),
                                        interleaved)                   scaled; dense first layers
    sarvam_mla, glm4_moe_lite         as deepseek_v3                 as deepseek_v3's (GLM-4.7-
                                                                       Flash: mlp_layer_types)
    mistral4      pre-norm              as deepseek_v3                 softmax top k in groups
                                                                       of the best two, scaled
    youtu         pre-norm              as deepseek_v3                 SwiGLU
    minicpm3      pre-norm, sublayers   as deepseek_v3 (rope in        SwiGLU; embeddings and
                  scaled                halves)                        logits scaled

A vision-language checkpoint whose language model is one of these (Gemma 3 4B and up, Mistral
Small 3.1, Ministral 3, LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, EXAONE 4.5) is served text-only:
its text_config and its language model's tensors (text_config_of, text_weight_name); the vision
tower and projector are not loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "gemma", "gemma2",
             "gemma3_text", "vaultgemma", "phi3", "hyperclovax", "jais2", "nemotron", "cwm",
             "apertus", "phimoe", "mellum", "nanochat", "arcee",
             "olmo2", "olmo3", "granite", "smollm3", "glm", "glm4", "helium", "internlm3",
             "ernie4_5", "seed_oss", "exaone4", "cohere", "cohere2", "stablelm", "mixtral",
             "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "dots1", "ernie4_5_moe",
             "gpt_oss", "minimax_m2", "flex_olmo", "exaone_moe", "granitemoe",
             "granitemoeshared", "granite_swa", "granitemoe_swa", "hunyuan_v1_dense",
             "hunyuan_v1_moe", "hy_v3", "solar_open", "afmoe", "deepseek_v2", "deepseek_v3",
             "glm4_moe_lite", "mistral4", "sarvam_mla", "youtu", "minicpm3", "qwen2_vl_text",
             "qwen2_5_vl_text", "qwen3_vl_text")
# another family's decoder under its own model_type (a difference of RoPE layout or windows
# is a switch: rotary_interleaved, layer_windows)
ALIASES = {"ministral": "mistral", "ministral3": "mistral",  # Ministral 8B (2410), Ministral 3
           "vaultgemma": "gemma2",  # Gemma 2 without its post-norms
           "hyperclovax": "granite",  # Granite with peri-LN (post-norms too) when use_post_norm
           "jais2": "llama",  # LayerNorms with biases, an ungated relu2 MLP with biases
           "nemotron": "llama",  # Jais 2's MLP, (1 + w) LayerNorms, a partial rotation
           "cwm": "llama",  # Code World Model: Llama with windows on 3 of 4 layers
           "apertus": "llama",  # q/k norms, an ungated MLP of xIELU
           "nanochat": "llama",  # weightless norms, relu2, RoPE reversed, q/k norms after it
           "arcee": "llama",  # Arcee's AFM: Llama with an ungated relu2 MLP
           "phimoe": "mixtral",  # Phi-3.5-MoE: LayerNorms, biases, its own router
           "mellum": "qwen3_moe",  # JetBrains Mellum: windows with a RoPE base of their own
           "internlm3": "llama", "helium": "llama", "ernie4_5": "llama", "seed_oss": "llama",
           "olmo3": "olmo2", "flex_olmo": "olmo2",  # FlexOlmo: OLMo 2's decoder, OLMoE's experts
           "granitemoe": "granite", "granitemoeshared": "granite",  # with their experts
           "granite_swa": "granite", "granitemoe_swa": "granite",  # with sinks and windows
           "hunyuan_v1_moe": "hunyuan_v1_dense",  # Hunyuan-A13B: the dense decoder's, experts
           "solar_open": "llama",  # Solar Open: Llama's attention, GLM-4.5's experts
           "hy_v3": "qwen3",  # Hunyuan 3: Qwen3's attention, MiniMax-M2's router
           # DeepSeek V3's latent attention: Sarvam (its experts too), GLM-4.7-Flash (dense
           # layers by mlp_layer_types), Mistral 4 (a softmax router), Youtu (dense)
           "sarvam_mla": "deepseek_v3", "glm4_moe_lite": "deepseek_v3",
           "mistral4": "deepseek_v3", "youtu": "deepseek_v3",
           "minicpm3": "deepseek_v3",  # with Granite-like scales, RoPE in halves
           # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's language models: on text alone their
           # multimodal RoPE turns every section by the same position, as plain RoPE does
           "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
_BIASED_O_PROJ = ("llama", "internlm3", "granite", "hyperclovax", "jais2", "nemotron", "phimoe",
                  "arcee",
                  "smollm3", "olmo2", "olmo3", "flex_olmo", "gpt_oss", "granitemoe",
                  "granitemoeshared", "granite_swa", "granitemoe_swa", "hunyuan_v1_dense",
                  "hunyuan_v1_moe", "hy_v3", "afmoe")
# LayerNorms with biases (mean-centred, as StableLM's); the ungated MLPs' activations
_LAYERNORM_BIAS = ("jais2", "nemotron", "phimoe")
_UNGATED = {"jais2": "relu2", "nemotron": "relu2", "apertus": "xielu", "nanochat": "relu2",
            "arcee": "relu2"}
# rotated pairs (2i, 2i + 1), as GPT-J's, where the others pair i with i + head_dim / 2
_INTERLEAVED = ("glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe", "cohere", "cohere2")


# multi-head latent attention (families.Latent: DeepSeek V3's attention under each name)
_LATENT = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4", "sarvam_mla", "youtu",
           "minicpm3")


# vision-language wrappers (HF model_type) of a supported language model
MULTIMODAL = ("gemma3", "mistral3", "llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "exaone4_5")
# their tensors outside the language model: not loaded
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "vision_model.", "visual.")


class UnsupportedModelError(ValueError):
    """A config.json whose model_type (or one of its options) no native module serves."""


def text_config_of(c: Any) -> tuple[Any, str]:
    """(the config a native module serves, the vision-language wrapper's model_type or "");
    a wrapper whose language model no native module serves comes back as it is."""
    if c.model_type in MULTIMODAL:
        text = c.get_text_config()
        if text is not c and text.model_type in SUPPORTED:
            return text, c.model_type
    return c, ""


def text_weight_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor name as its language model's own checkpoint
    names it (language_model.model.X or model.language_model.X: model.X;
    language_model.lm_head: lm_head), None for the vision tower and projector."""
    bare = name.removeprefix("model.")
    if bare.startswith(_VISION_PREFIXES):
        return None
    if name.startswith("language_model.model."):
        return "model." + name.removeprefix("language_model.model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name.removeprefix("language_model.")


@dataclass(frozen=True, slots=True)
class Moe:
    """A mixture-of-experts MLP: a router picks top_k of num_experts, each a SwiGLU of width
    intermediate_size; Qwen2-MoE adds an always-on shared expert scaled by sigmoid(gate(x)),
    GLM-4.5 one unscaled. The router is a softmax, or (scoring "sigmoid", DeepSeek-V3's as
    GLM-4.5 has it) sigmoid scores plus a per-expert correction bias choosing the experts
    within the topk_group best of n_group groups, weighted by the plain scores times
    routed_scaling."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # top-k weights rescaled to sum 1 (Mixtral, Qwen3-MoE's norm_topk_prob)
    shared_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP (False)
    shared_gated: bool = True  # the shared expert scaled by sigmoid(shared_expert_gate(x))
    scoring: str = "softmax"  # or "sigmoid", "softmax_bias" (ERNIE 4.5's: softmax scores
    # chosen with a correction bias), "sparsemixer" (Phi-3.5-MoE's, moe.sparsemixer),
    # "softmax_groups" (DeepSeek V2's: softmax top k within the groups of the best single
    # score, moe.grouped_route), "softmax_groups_top2" (Mistral 4's: of the best two's sum)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    norm_min: float = 0.0  # renormalized weights divide by max(sum, norm_min) (ERNIE), else
    # by sum + 1e-20
    # gpt-oss: a bias on the router and on each expert's projections, and the clamped
    # activation "swiglu_oai" ((up + 1) * gate * sigmoid(alpha * gate)) in place of SiLU's
    biases: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_float32: bool = False  # the router's weight and logits in float32 (Hunyuan's wg)
    jitter_eps: float = 0.0  # scoring "sparsemixer" (Phi-3.5-MoE's top 2): router_jitter_noise


@dataclass(frozen=True, slots=True)
class Latent:
    """Multi-head latent attention (DeepSeek V2/V3's MLA). A token's keys and values are one
    latent of kv_lora_rank (RMS-normed) and one key part of rope dims shared by every head;
    head i's key is [W_UK[i] latent, rope part], its value W_UV[i] latent (kv_b_proj holds
    W_UK and W_UV). The cache holds the latent and the rotated rope part: one KV head of
    kv_lora_rank + rope (576 for DeepSeek V3: 1,152 bytes a token a layer in bf16, where
    its 128 heads' expanded keys and values take 128 x (192 + 128) x 2 bytes, 71x more).
    Attention runs absorbed, as vLLM's MLA
    does: q_nope @ W_UK against the latent (one KV head for all heads, the latent its own
    value), the output through W_UV."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v: int  # v_head_dim
    interleaved: bool  # rope pairs (2i, 2i + 1) (rope_interleave): permuted at load


def _latent(c: Any) -> Latent | None:
    if c.model_type not in _LATENT:
        return None
    if c.qk_rope_head_dim % 2:
        raise UnsupportedModelError(f"{c.model_type}: an odd qk_rope_head_dim "
                                    f"({c.qk_rope_head_dim})")
    return Latent(int(c.q_lora_rank or 0), int(c.kv_lora_rank), int(c.qk_nope_head_dim),
                  int(c.qk_rope_head_dim), int(c.v_head_dim),
                  c.model_type == "deepseek_v2"  # (its complex rotation; MiniCPM3's halves)
                  or c.model_type != "minicpm3" and bool(getattr(c, "rope_interleave", True)))


def latent_scale(c: Any, latent: Latent) -> float:
    """MLA's softmax scale, as HF's yarn_apply_mscale: qk_head_dim ** -0.5, times mscale
    squared where a YaRN-type RoPE sets mscale_all_dim (DeepSeek V3's 0.1 ln(40) + 1)."""
    scale = (latent.nope + latent.rope) ** -0.5
    rope = getattr(c, "rope_parameters", None) or {}
    all_dim = rope.get("mscale_all_dim") or 0
    if rope.get("rope_type", "default") != "default" and all_dim:
        factor = float(rope["factor"])
        mscale = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def family_fields(c: Any) -> dict[str, Any]:
    """The decoder's switches for HF config `c` (keys of ModelConfig); raises
    UnsupportedModelError naming what is supported."""
    if c.model_type not in SUPPORTED:
        raise UnsupportedModelError(f"unsupported model_type {c.model_type!r}: supported are "
                                    f"{', '.join(SUPPORTED)}")
    interleaved = c.model_type in _INTERLEAVED
    mt = ALIASES.get(c.model_type, c.model_type)
    for switch in ("use_qk_norm", "qk_layernorm"):  # Cohere's, StableLM's per-head LayerNorm
        if getattr(c, switch, False) and c.model_type in ("cohere", "stablelm"):
            raise UnsupportedModelError(f"{c.model_type}: LayerNorms of q and k ({switch}) "
                                        "are not supported")
    if getattr(c, "use_bias", False):  # ERNIE 4.5: every linear
        raise UnsupportedModelError(f"{c.model_type}: biases on every linear (use_bias) are "
                                    "not supported")
    rope = getattr(c, "rope_parameters", None) or {}
    factors = {float(v.get("partial_rotary_factor", 1.0)) for v in (rope, *rope.values())
               if isinstance(v, dict)} | {float(getattr(c, "partial_rotary_factor", 1.0))}
    factor = min(factors)
    if getattr(c, "clip_qkv", None) is not None:
        raise UnsupportedModelError(f"{c.model_type}: clipped q, k and v (clip_qkv) are not "
                                    "supported")
    gemma, granite = mt in ("gemma", "gemma2", "gemma3_text"), mt == "granite"
    minicpm = c.model_type == "minicpm3"  # embeddings, sublayers and logits scaled (muP)
    cohere = mt in ("cohere", "cohere2")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotary_dim = int(head_dim * factor)  # as HF's rope_init_fn sizes it
    latent = _latent(c)
    if latent is not None:  # (Mistral 4's partial factor: the rope part of its q heads)
        rotary_dim = head_dim
    elif factor != 1.0 and (mt not in ("phi3", "glm", "glm4", "glm4_moe", "stablelm",
                                     "minimax_m2") and c.model_type != "nemotron"
                          or rotary_dim % 2
                          or (head_dim - rotary_dim) % 2):
        raise UnsupportedModelError(f"{c.model_type}: partial rotary embeddings "
                                    f"(partial_rotary_factor {factor:g}) are not supported "
                                    f"natively (phi3's, stablelm's, nemotron's and glm's "
                                    f"are, of an even share of an even head)")
    qk_norms = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "exaone4": "head",
                "dots1": "head", "olmo2": "full", "olmoe": "full", "minimax_m2": "full",
                "exaone_moe": "head", "afmoe": "head", "apertus": "head",
                "hunyuan_v1_dense": "head_after_rope", "nanochat": "head_after_rope",
                "glm4_moe": "head" if getattr(c, "use_qk_norm", False) else ""}  # (own, or alias's)
    fields: dict[str, Any] = {
        "latent": latent,
        "qk_norm": qk_norms.get(c.model_type, qk_norms.get(mt, "")),
        "norm_style": "pre" if c.model_type == "vaultgemma"
        else "sandwich" if gemma and mt != "gemma" or mt in ("glm4", "afmoe")
        or getattr(c, "use_post_norm", False) and c.model_type == "hyperclovax"
        else "post" if mt in ("olmo2", "exaone4")
        else "parallel" if cohere or getattr(c, "use_parallel_residual", False) else "pre",
        "norm_type": "layer" if cohere or mt == "stablelm" or c.model_type in _LAYERNORM_BIAS
        else "rms",
        "norm_bias": mt == "stablelm" or c.model_type in _LAYERNORM_BIAS,
        "lm_head_bias": bool(getattr(c, "lm_head_bias", False)),
        "norm_offset": 1.0 if gemma or c.model_type == "nemotron" else 0.0,  # (LayerNorm1P)
        "hidden_act": "gelu_tanh" if gemma else _UNGATED.get(c.model_type, "silu"),
        "mlp_gated": c.model_type not in _UNGATED,
        "mlp_bias": bool(getattr(c, "mlp_bias", False)),
        "embed_scale": c.hidden_size**0.5 if gemma or getattr(c, "mup_enabled", False)
        else float(c.embedding_multiplier) if granite
        else float(c.scale_emb) if minicpm else 1.0,
        "embed_scale_in_dtype": gemma or minicpm,
        "attn_scale": float(c.attention_multiplier) if granite
        else latent_scale(c, latent) if latent
        else (getattr(c, "query_pre_attn_scalar", None) or head_dim) ** -0.5,
        "residual_scale": float(c.residual_multiplier) if granite
        else float(c.scale_depth) / c.num_hidden_layers**0.5 if minicpm else 1.0,
        "logit_scale": float(c.logits_scaling) if c.model_type == "hyperclovax"  # times it
        else 1.0 / float(c.logits_scaling) if granite or minicpm
        else float(c.logit_scale) if cohere else 1.0,
        "attn_softcap": float(getattr(c, "attn_logit_softcapping", None) or 0.0),
        "final_softcap": float(getattr(c, "final_logit_softcapping", None) or 0.0),
        "layer_windows": _windows(c),
        "rotary_dim": rotary_dim if rotary_dim < head_dim else 0,
        "rotary_interleaved": interleaved,
        "rope_layers": _rope_layers(c),
        "layer_rope_theta": _layer_rope_theta(c),
        "local_rope": isinstance(rope.get("sliding_attention"), dict),  # Gemma 3, OLMo 3
        "attention_bias": bool(getattr(c, "attention_bias", mt in ("qwen2", "qwen2_moe"))
                               or getattr(c, "use_qkv_bias", False)),
        # HF's Llama, Granite, SmolLM3 and OLMo put attention_bias on o_proj too
        "o_proj_bias": bool(getattr(c, "attention_out_bias", False)) if c.model_type == "seed_oss"
        else bool(getattr(c, "attention_bias", False)) and c.model_type in _BIASED_O_PROJ,
        "moe": _moe(c),
        "attn_sinks": c.model_type in ("gpt_oss", "granite_swa", "granitemoe_swa"),
        "attn_output_gate": mt == "afmoe",
        "norm_weightless": c.model_type == "nanochat",
        "embed_norm": c.model_type == "nanochat",
        "rope_reversed": c.model_type == "nanochat",
        "q_position_scale": (float(rope["llama_4_scaling_beta"]),
                             int(rope["original_max_position_embeddings"]))
        if c.model_type in ("ministral3", "mistral4") and rope.get("llama_4_scaling_beta")
        else (),
    }
    act = (getattr(c, "hidden_activation", None) or "gelu_pytorch_tanh") if gemma \
        else getattr(c, "hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if gemma else _UNGATED.get(c.model_type, "silu")):
        raise UnsupportedModelError(f"{mt}: activation {act!r} is not supported")
    return fields


def _rope_layers(c: Any) -> tuple[bool, ...]:
    """Per layer: whether it rotates q and k; () where every layer does. SmolLM3's
    no_rope_layers; EXAONE 4's global layers when it has windows; Cohere 2's."""
    if c.model_type == "smollm3":
        return tuple(bool(r) for r in c.no_rope_layers)
    if c.model_type in ("exaone4", "exaone_moe") and getattr(c, "sliding_window", None):
        return tuple(t == "sliding_attention" for t in c.layer_types)
    if c.model_type == "afmoe":  # RoPE on the windowed layers only
        return tuple(t == "sliding_attention" for t in c.layer_types)
    if c.model_type == "cohere2":  # RoPE only where a window is
        return tuple(bool(c.sliding_window) and t == "sliding_attention" for t in c.layer_types)
    if getattr(c, "layer_rope_theta", None):  # Granite SWA's base 0: no RoPE
        return tuple(bool(t) for t in c.layer_rope_theta)
    return ()


def _layer_rope_theta(c: Any) -> tuple[float, ...]:
    """Per layer: its RoPE base where a config sets one a layer (Granite SWA's
    layer_rope_theta, 0: none); () where every layer takes the config's."""
    thetas = getattr(c, "layer_rope_theta", None)
    if not thetas:
        return ()
    if len(thetas) != c.num_hidden_layers:
        raise UnsupportedModelError(f"{c.model_type}: layer_rope_theta has {len(thetas)} "
                                    f"entries for {c.num_hidden_layers} layers")
    return tuple(float(t) for t in thetas)


def _windows(c: Any) -> tuple[int, ...]:
    """Per layer: the sliding window in tokens (0: full attention). A config with layer_types
    windows only its sliding_attention layers; one without (Mistral, Mixtral, Phi-3) all of
    them when sliding_window is set."""
    window = int(getattr(c, "sliding_window", None) or 0)
    types = getattr(c, "layer_types", None)
    if types is None:
        return (window,) * c.num_hidden_layers
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _uniform(c: Any, key: str) -> int:
    """c.key, an int or a list of one per layer (Hunyuan's): the same for every layer."""
    value = getattr(c, key)
    values = set(value) if isinstance(value, (list, tuple)) else {value}
    if len(values) != 1:
        raise UnsupportedModelError(f"{c.model_type}: {key} differs between layers ({value}); "
                                    f"the native module takes one value for every layer")
    return int(values.pop())


def _moe(c: Any) -> Moe | None:
    mt = c.model_type
    if c.model_type == "mellum":  # Qwen3-MoE's experts; dense layers by mlp_layer_types
        return Moe(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   bool(c.norm_topk_prob),
                   sparse_layers=tuple(t == "sparse" for t in c.mlp_layer_types))
    if c.model_type == "phimoe":  # Mixtral's experts, routed by the sparsemixer (top 2)
        if c.num_experts_per_tok != 2:
            raise UnsupportedModelError(f"phimoe: num_experts_per_tok {c.num_experts_per_tok}"
                                        f" (the sparsemixer router picks 2)")
        return Moe(c.num_local_experts, 2, c.intermediate_size, False,
                   sparse_layers=(True,) * c.num_hidden_layers, scoring="sparsemixer",
                   jitter_eps=float(c.router_jitter_noise))
    if mt == "mixtral":
        n = c.num_local_experts
        return Moe(n, c.num_experts_per_tok, c.intermediate_size, True,
                   sparse_layers=(True,) * c.num_hidden_layers)
    if mt in ("olmoe", "flex_olmo"):
        return Moe(c.num_experts, c.num_experts_per_tok, c.intermediate_size,
                   bool(c.norm_topk_prob), sparse_layers=(True,) * c.num_hidden_layers)
    if mt == "ernie4_5_moe":
        start, end, every = c.moe_layer_start_index, c.moe_layer_end_index, c.moe_layer_interval
        return Moe(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, True,
                   c.moe_intermediate_size * c.moe_num_shared_experts,
                   tuple((i + 1) % every == 0 and start <= i <= end
                         for i in range(c.num_hidden_layers)),
                   shared_gated=False, scoring="softmax_bias", norm_min=float(c.moe_norm_min))
    if c.model_type == "glm4_moe_lite":  # dense layers by mlp_layer_types
        return _deepseek_v3_moe(c, c.n_routed_experts, c.n_shared_experts,
                                tuple(t == "sparse" for t in c.mlp_layer_types))
    if c.model_type == "mistral4":  # softmax scores, chosen within the groups of the best
        # two, renormalized where norm_topk_prob says, scaled; dense first layers
        return Moe(c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   bool(c.norm_topk_prob), c.moe_intermediate_size * c.n_shared_experts,
                   tuple(i >= (c.first_k_dense_replace or 0)
                         for i in range(c.num_hidden_layers)),
                   shared_gated=False, scoring="softmax_groups_top2",
                   n_group=int(c.n_group or 1), topk_group=int(c.topk_group or 1),
                   routed_scaling=float(c.routed_scaling_factor))
    if mt == "deepseek_v2":  # softmax top k (in groups: group_limited_greedy), scaled
        method = getattr(c, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"deepseek_v2: topk_method {method!r} (greedy and "
                                        f"group_limited_greedy are supported)")
        groups = int(c.n_group or 1) if method == "group_limited_greedy" else 1
        if c.n_routed_experts % groups:
            raise UnsupportedModelError(f"deepseek_v2: {c.n_routed_experts} experts in "
                                        f"{groups} groups")
        # (HF's DeepseekV2TopkRouter renormalizes nothing, whatever norm_topk_prob says)
        return Moe(c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, False,
                   c.moe_intermediate_size * c.n_shared_experts,
                   tuple(i >= c.first_k_dense_replace for i in range(c.num_hidden_layers)),
                   shared_gated=False, scoring="softmax_groups", n_group=groups,
                   topk_group=int(c.topk_group or 1) if groups > 1 else 1,
                   routed_scaling=float(c.routed_scaling_factor))
    if mt in ("glm4_moe", "dots1", "deepseek_v3", "sarvam_mla"):
        return _deepseek_v3_moe(c, c.n_routed_experts, c.n_shared_experts, tuple(
            i >= c.first_k_dense_replace for i in range(c.num_hidden_layers)))
    if mt == "hy_v3":  # sigmoid scores chosen with a bias, renormalized, scaled; dense layers
        # by mlp_layer_types
        return Moe(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, True,
                   c.moe_intermediate_size * c.num_shared_experts,
                   tuple(t == "sparse" for t in c.mlp_layer_types), shared_gated=False,
                   scoring="sigmoid", routed_scaling=float(c.router_scaling_factor))
    if mt == "afmoe":  # as HY V3's router, scaled by route_scale; dense first layers
        return Moe(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, True,
                   c.moe_intermediate_size * c.num_shared_experts,
                   tuple(i >= c.num_dense_layers for i in range(c.num_hidden_layers)),
                   shared_gated=False, scoring="sigmoid", routed_scaling=float(c.route_scale))
    if mt == "solar_open":  # experts on every layer
        return _deepseek_v3_moe(c, c.n_routed_experts, c.n_shared_experts,
                                (True,) * c.num_hidden_layers)
    if mt == "exaone_moe":  # dense layers by mlp_layer_types
        return _deepseek_v3_moe(c, c.num_experts, c.num_shared_experts,
                                tuple(t == "sparse" for t in c.mlp_layer_types))
    if mt in ("granitemoe", "granitemoeshared", "granitemoe_swa"):  # softmax of the top k
        return Moe(c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, True,
                   int(getattr(c, "shared_intermediate_size", 0) or 0),
                   (True,) * c.num_hidden_layers, shared_gated=False)
    if mt == "hunyuan_v1_moe":  # softmax top k, renormalized, and an MLP beside every layer's
        experts, top_k = (_uniform(c, key) for key in ("num_experts", "moe_topk"))
        return Moe(experts, top_k, c.intermediate_size, True, c.intermediate_size,
                   (True,) * c.num_hidden_layers, shared_gated=False, router_float32=True)
    if mt == "minimax_m2":  # DeepSeek-V3's sigmoid choice with its bias, in one group
        return Moe(c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, True,
                   sparse_layers=(True,) * c.num_hidden_layers, scoring="sigmoid")
    if mt == "gpt_oss":  # softmax over the top k's logits: the renormalized softmax's weights
        # the released config.json names no alpha; transformers before 5.2x hard-codes 1.702
        return Moe(c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, True,
                   sparse_layers=(True,) * c.num_hidden_layers, biases=True,
                   activation="swiglu_oai",
                   swiglu_alpha=float(getattr(c, "swiglu_alpha", None) or 1.702),
                   swiglu_limit=float(getattr(c, "swiglu_limit", None) or 7.0))
    if mt not in ("qwen2_moe", "qwen3_moe"):
        return None
    skip = set(getattr(c, "mlp_only_layers", None) or ())
    step = getattr(c, "decoder_sparse_step", 1) or 1
    sparse = tuple(i not in skip and c.num_experts > 0 and (i + 1) % step == 0
                   for i in range(c.num_hidden_layers))
    shared = getattr(c, "shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
    return Moe(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
               bool(getattr(c, "norm_topk_prob", False)), shared or 0, sparse)


def _deepseek_v3_moe(c: Any, experts: int, shared: int, sparse: tuple[bool, ...]) -> Moe:
    """DeepSeek-V3's experts as GLM-4.5, dots.llm1, EXAONE MoE and Solar Open configure them:
    the grouped sigmoid router with its correction bias, `shared` unscaled shared experts."""
    if experts % c.n_group or c.n_group > 1 and experts // c.n_group < 2:
        raise UnsupportedModelError(f"{c.model_type}: {experts} experts in n_group "
                                    f"{c.n_group} groups (the router needs whole groups of "
                                    f"at least two)")
    return Moe(experts, c.num_experts_per_tok, c.moe_intermediate_size, bool(c.norm_topk_prob),
               c.moe_intermediate_size * shared, sparse, shared_gated=False, scoring="sigmoid",
               n_group=c.n_group, topk_group=c.topk_group,
               routed_scaling=float(c.routed_scaling_factor))
