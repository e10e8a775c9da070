"""Every native family against HF transformers on a tiny random config (fp32, CPU): logits
across chunked prefill and decode, with sliding windows shorter than the sequences; the RoPE
scalings against HF's own rotary embedding."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.families import SUPPORTED, UnsupportedModelError
from pagedserve.executor.layers import rope_cos_sin_cache
from pagedserve.executor.loader import build_model
from pagedserve.kernels import get_ops
from tests.executor_svc.test_model import TINY, assert_paged_equals_hf, run_paged

WINDOW = 6  # shorter than the test sequences, not a multiple of the block size (4)
FAMILIES = {
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "olmo2": dict(model_type="olmo2"),
    # post-norms, q/k norms per head, windows, the global layers without RoPE
    "exaone4": dict(model_type="exaone4", head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], pad_token_id=0),
    # OLMo 2 with windows on its sliding layers, their own RoPE base
    "olmo3": dict(model_type="olmo3", sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"]),
    # Llama's decoder under other names; Helium's and ERNIE 4.5's rotation in (2i, 2i + 1)
    "internlm3": dict(model_type="internlm3"),
    "helium": dict(model_type="helium", head_dim=16, pad_token_id=0),
    "ernie4_5": dict(model_type="ernie4_5", head_dim=16, pad_token_id=0),
    "seed_oss": dict(model_type="seed_oss", head_dim=16, pad_token_id=0,  # qkv, o biases
                     attention_out_bias=True),
    "llama-bias": dict(model_type="llama", attention_bias=True),  # q, k, v and o biases
    "olmo2-bias": dict(model_type="olmo2", attention_bias=True),
    "granite": dict(model_type="granite", embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=True),
    "smollm3": dict(model_type="smollm3", no_rope_layers=[1, 0], pad_token_id=0),
    "phi3": dict(model_type="phi3", pad_token_id=0, sliding_window=WINDOW),
    "phi3-longrope": dict(model_type="phi3", pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "long_factor": [1.0 + i / 4 for i in range(8)],
        "short_factor": [1.0 + i / 16 for i in range(8)]}),
    # Phi-4-mini's shape: a quarter of each head passes unrotated, LongRoPE over the rest
    "phi3-partial": dict(model_type="phi3", pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.75, "long_factor": [1.0 + i / 4 for i in range(6)],
        "short_factor": [1.0 + i / 16 for i in range(6)]}),
    # half of each head rotated in (2i, 2i + 1) pairs, qkv biases; GLM-4: four norms a layer
    "glm": dict(model_type="glm", head_dim=16, pad_token_id=0),
    "glm4": dict(model_type="glm4", head_dim=16, pad_token_id=0),
    "mistral-window": dict(model_type="mistral", sliding_window=WINDOW),
    "gemma": dict(model_type="gemma", head_dim=16),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=WINDOW,
                   query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention"],
                   query_pre_attn_scalar=16),
    # one LayerNorm a layer, attention beside the MLP, RoPE in (2i, 2i + 1) pairs, logits
    # scaled; Cohere 2: windows, no RoPE on its global layers
    "cohere": dict(model_type="cohere", logit_scale=0.5, tie_word_embeddings=False),
    "cohere2": dict(model_type="cohere2", logit_scale=0.5, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
    # LayerNorms with biases, a quarter of each head rotated, qkv biases; parallel if set
    "stablelm": dict(model_type="stablelm", partial_rotary_factor=0.25, use_qkv_bias=True),
    "stablelm-parallel": dict(model_type="stablelm", partial_rotary_factor=0.25,
                              use_parallel_residual=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      mlp_only_layers=[1]),
    "qwen3-moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2,
                  intermediate_size=32),
    # sigmoid scores with a correction bias, experts in 2 groups of which the best 1,
    # renormalized and scaled; an unscaled shared expert; a dense first layer; half rotary
    "glm4-moe": dict(model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     use_qk_norm=True, attention_bias=True, pad_token_id=0),
    # softmax scores chosen with a correction bias, renormalized; shared experts; dense
    # layers before moe_layer_start_index; RoPE in (2i, 2i + 1) pairs
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, moe_num_shared_experts=1,
                         moe_layer_start_index=1, moe_layer_end_index=1, moe_layer_interval=1,
                         head_dim=16, pad_token_id=0),
    # Qwen3's attention, DeepSeek-V3's experts (the router as GLM-4.5's)
    "dots1": dict(model_type="dots1", n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
                  n_group=4, topk_group=2, routed_scaling_factor=1.5, pad_token_id=0),
    # EXAONE 4's attention (global layers without RoPE) in a pre-norm decoder, DeepSeek-V3's
    # grouped sigmoid router and shared expert, a dense first layer
    "exaone_moe": dict(model_type="exaone_moe", num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, num_shared_experts=1, n_group=2,
                       topk_group=1, head_dim=16, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention"]),
    # Granite's four multipliers with softmax-over-top-k experts, stacked in its own names
    # (input_linear, output_linear, router.layer), and (shared) an unscaled shared MLP
    "granitemoe": dict(model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2,
                       intermediate_size=32, embedding_multiplier=2.0, residual_multiplier=0.5,
                       attention_multiplier=0.2, logits_scaling=4.0, pad_token_id=0),
    "granitemoeshared": dict(model_type="granitemoeshared", num_local_experts=4,
                             num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48, attention_bias=True,
                             embedding_multiplier=2.0, residual_multiplier=0.5,
                             attention_multiplier=0.2, logits_scaling=4.0, pad_token_id=0),
    # Llama with RMSNorm of each q and k head after RoPE, NTK-alpha RoPE, biases
    "hunyuan_v1_dense": dict(model_type="hunyuan_v1_dense", head_dim=16, attention_bias=True,
                             rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                              "factor": 1.0, "rope_theta": 10000.0}),
    # Granite with a sink logit per head, windows on some layers, a RoPE base per layer
    # (0: none)
    "granite_swa": dict(model_type="granite_swa", sliding_window=6, head_dim=16,
                        initializer_range=0.1,
                        layer_rope_theta=[10000.0, 500.0], embedding_multiplier=2.0,
                        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
                        attention_bias=True, layer_types=["full_attention", "sliding_attention"]),
    "granitemoe_swa": dict(model_type="granitemoe_swa", sliding_window=6, num_local_experts=4,
                           initializer_range=0.1,
                           num_experts_per_tok=2, intermediate_size=32,
                           shared_intermediate_size=48, layer_rope_theta=[0, 10000.0],
                           embedding_multiplier=2.0, residual_multiplier=0.5,
                           attention_multiplier=0.2, logits_scaling=4.0,
                           layer_types=["sliding_attention", "full_attention"]),
    # Llama's attention, GLM-4.5's grouped sigmoid router and shared expert on every layer
    "solar_open": dict(model_type="solar_open", head_dim=16, n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                       topk_group=1, routed_scaling_factor=1.5, attention_bias=True),
    # Qwen3's attention; sigmoid scores chosen with a bias, scaled; a dense first layer
    "hy_v3": dict(model_type="hy_v3", head_dim=16, num_experts=4, num_experts_per_tok=2,
                  initializer_range=0.1,
                  moe_intermediate_size=32, router_scaling_factor=2.5, attention_bias=True),
    # sandwich norms, q/k norms, windows with RoPE and global layers without, the attention's
    # output gated; sigmoid router with a choice bias, scaled; a dense first layer
    "afmoe": dict(model_type="afmoe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_shared_experts=1, route_scale=2.0,
                  global_attn_every_n_layers=2, sliding_window=6, initializer_range=0.1,
                  mup_enabled=True, attention_bias=True),
    # Mistral with windows by layer_types (Ministral 8B's)
    "ministral": dict(model_type="ministral", sliding_window=6, head_dim=16,
                      layer_types=["sliding_attention", "full_attention"]),
    # Mistral with YaRN and Llama 4's query scale by position (orig 8: positions 8 and up
    # scaled, as 16,384 and up are in the released configs)
    "ministral3": dict(model_type="ministral3", head_dim=16, initializer_range=0.1,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                        "factor": 4.0, "original_max_position_embeddings": 8,
                                        "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale_all_dim": 1.0, "mscale": 1.0,
                                        "llama_4_scaling_beta": 0.5}),
    # Gemma 2 with pre-norms only
    "vaultgemma": dict(model_type="vaultgemma", head_dim=16, sliding_window=6,
                       layer_types=["sliding_attention", "full_attention"],
                       query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                       final_logit_softcapping=10.0),
    # Granite's multipliers (logits times logits_scaling) with peri-LN: a norm after each
    # sublayer too, its output then times residual_multiplier
    "hyperclovax": dict(model_type="hyperclovax", head_dim=16, embedding_multiplier=2.0,
                        residual_multiplier=0.5, attention_multiplier=0.2,
                        logits_scaling=0.25, attention_bias=True, initializer_range=0.1),
    # LayerNorms with biases, biases on attention and on an ungated relu2 MLP
    "jais2": dict(model_type="jais2", head_dim=16, initializer_range=0.1),
    # Jais 2's MLP, LayerNorms of (1 + w) with biases, half of each head rotated
    "nemotron": dict(model_type="nemotron", head_dim=16, initializer_range=0.1,
                     attention_bias=True, mlp_bias=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.5}),
    # Llama with windows by layer_types, llama3 RoPE
    "cwm": dict(model_type="cwm", head_dim=16, sliding_window=6,
                layer_types=["full_attention", "sliding_attention"]),
    # Llama with q/k norms per head and an ungated MLP of xIELU (learned per layer)
    "apertus": dict(model_type="apertus", head_dim=16, initializer_range=0.1),
    # Mixtral's experts under the sparsemixer router (a wide jitter: fewer experts inside
    # it), LayerNorms and biases (on the LM head too), LongRoPE
    "phimoe": dict(model_type="phimoe", num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=32, router_jitter_noise=0.5, attention_bias=True,
                   lm_head_bias=True, initializer_range=0.1, rope_parameters={
                       "rope_type": "longrope", "rope_theta": 10000.0,
                       "original_max_position_embeddings": 64,
                       "long_factor": [1.0 + i / 4 for i in range(8)],
                       "short_factor": [1.0 + i / 16 for i in range(8)],
                       "short_mscale": 1.25, "long_mscale": 1.25}),
    # Qwen3-MoE's attention and experts, windows with their own RoPE base, a dense layer
    "mellum": dict(model_type="mellum", head_dim=16, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, sliding_window=6, initializer_range=0.1,
                   layer_types=["sliding_attention", "full_attention"],
                   mlp_layer_types=["dense", "sparse"], rope_parameters={
                       "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    # weightless RMSNorms (one after the embeddings too), RoPE turned the other way, q/k norms
    # after it, an ungated relu2 MLP (fc1, fc2), a soft-capped LM head
    "nanochat": dict(model_type="nanochat", num_key_value_heads=2, initializer_range=0.1,
                     final_logit_softcapping=5.0),
    # Llama with an ungated relu2 MLP, YaRN
    "arcee": dict(model_type="arcee", head_dim=16, initializer_range=0.1, attention_bias=True,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    # latent attention (q through its own low rank, interleaved rope pairs, YaRN with
    # mscale_all_dim: the softmax scale too), a dense first layer, then GLM-4.5's experts
    "deepseek_v3": dict(model_type="deepseek_v3", q_lora_rank=16, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=32, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, initializer_range=0.1, rope_parameters={
                            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 128, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                        num_key_value_heads=4),  # (HF's MLA takes as many as heads)
    # q straight from the hidden state (DeepSeek-V2-Lite's shape), rope pairs in halves,
    # attention biases
    "deepseek_v3-q-proj": dict(model_type="deepseek_v3", q_lora_rank=None, kv_lora_rank=16,
                               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                               n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                               topk_group=1, moe_intermediate_size=32, rope_interleave=False,
                               first_k_dense_replace=0, attention_bias=True,
                               initializer_range=0.1, num_key_value_heads=4),
    # 32 query heads on the one latent: read as two KV heads aliasing it (LATENT_GROUP)
    "deepseek_v3-32-heads": dict(model_type="deepseek_v3", q_lora_rank=None, kv_lora_rank=16,
                                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                 n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                 topk_group=1, moe_intermediate_size=32,
                                 num_attention_heads=32, num_key_value_heads=32,
                                 initializer_range=0.1),
    # DeepSeek V2's latent attention (its rotation in interleaved pairs; YaRN's mscales as
    # V2-Lite's), a dense first layer, softmax top k within the best group, scaled
    "deepseek_v2": dict(model_type="deepseek_v2", q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                        topk_method="group_limited_greedy", moe_intermediate_size=32,
                        n_shared_experts=2, first_k_dense_replace=1,
                        routed_scaling_factor=2.0, initializer_range=0.1,
                        num_key_value_heads=4, rope_parameters={
                            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 128, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # DeepSeek V3's latent attention under other names: GLM-4.7-Flash (dense layers by
    # mlp_layer_types), Sarvam (V3's experts), Mistral 4 (softmax top k in the groups of the
    # best two, renormalized, scaled), Youtu (a dense MLP, tied embeddings)
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", q_lora_rank=16, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                          n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                          moe_intermediate_size=32, mlp_layer_types=["sparse", "dense"],
                          routed_scaling_factor=1.8, initializer_range=0.1,
                          num_key_value_heads=4),
    "sarvam_mla": dict(model_type="sarvam_mla", q_lora_rank=None, kv_lora_rank=16,
                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       first_k_dense_replace=1, initializer_range=0.1, num_key_value_heads=4),
    "mistral4": dict(model_type="mistral4", q_lora_rank=16, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     moe_intermediate_size=32, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, initializer_range=0.1, num_key_value_heads=4,
                     pad_token_id=0, rope_parameters={  # q scaled from position 8 on
                         "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                         "llama_4_scaling_beta": 0.5, "partial_rotary_factor": 0.5}),
    "youtu": dict(model_type="youtu", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=8, initializer_range=0.1,
                  num_key_value_heads=4),
    # latent attention with RoPE in halves and LongRoPE, muP's scales: embeddings times
    # scale_emb, each sublayer times scale_depth / sqrt(layers), logits times base / hidden
    "minicpm3": dict(model_type="minicpm3", q_lora_rank=16, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, scale_emb=3.0,
                     scale_depth=1.4, dim_model_base=16, initializer_range=0.1,
                     num_key_value_heads=4, rope_parameters={
                         "rope_type": "longrope", "rope_theta": 10000.0,
                         "original_max_position_embeddings": 64,  # (past the sequences)
                         "factor": 4.0,  # (transformers 5.17's MiniCPM3 reads it always)
                         "long_factor": [1.0, 1.5, 2.0, 3.0],
                         "short_factor": [1.0, 1.1, 1.2, 1.3]}),
    # Llama with MLP biases
    "llama-mlp-bias": dict(model_type="llama", mlp_bias=True, attention_bias=True),
    # Hunyuan dense's attention; top-k experts routed in float32 beside an always-on MLP
    "hunyuan_v1_moe": dict(model_type="hunyuan_v1_moe", head_dim=16, num_experts=4,
                           moe_topk=[2, 2], intermediate_size=32,
                           rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                            "factor": 1.0, "rope_theta": 10000.0}),
    # OLMo 2's post-norm decoder with OLMoE's experts (not renormalized)
    "flex_olmo": dict(model_type="flex_olmo", num_experts=4, num_experts_per_tok=2,
                      intermediate_size=32, pad_token_id=0),
    # sigmoid scores chosen with a correction bias (one group), RMSNorm of the whole q and k,
    # half of each head rotated (the released config's legacy rotary_dim)
    "minimax_m2": dict(model_type="minimax_m2", num_local_experts=8, num_experts_per_tok=2,
                       head_dim=16, rotary_dim=8),
    # a sink logit per head, biases on attention, router and experts, the clamped SwiGLU,
    # windows on alternate layers, YaRN; weights large enough for the clamps to bite
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=WINDOW, initializer_range=0.1,
                    swiglu_limit=1.0, rope_parameters={
                        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                        "original_max_position_embeddings": 64}),
}


def perturb_norms(model) -> None:
    """Norms initialise to 1 (or 0 for (1 + w)) and biases to 0 (a sigmoid router's
    correction bias and gpt-oss's expert biases too): move them, and gpt-oss's sinks, so that
    they count."""
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("bias", ".sinks")):
                p.add_(0.1 * torch.randn_like(p))


def as_hf_computes(model) -> None:
    """Write into the config what this transformers' modeling code computes: before 5.2x,
    GptOssExperts hard-codes alpha 1.702 and limit 7.0 whatever the config says (the
    device's 5.17 does), and FAMILIES' gpt-oss clamps at 1.0."""
    experts = next((m for m in model.modules() if type(m).__name__ == "GptOssExperts"), None)
    if experts is not None:
        model.config.swiglu_alpha, model.config.swiglu_limit = experts.alpha, experts.limit


def causal_lm_registered(model_type: str) -> None:
    """Register a causal LM transformers' auto mapping lacks (Mistral 4 in 5.25) from its
    config's architectures, as ModelConfig does for the fallback."""
    from pagedserve.executor.config import _register_causal_lm

    config = AutoConfig.for_model(model_type)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    _register_causal_lm(config)


def hf_and_ours_of(d: dict, tmp_path, seed: int = 0):
    torch.manual_seed(seed)
    d = dict(d)
    causal_lm_registered(d["model_type"])
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"),
                                                               **{**TINY, **d}),
                                          dtype=torch.float32).eval()
    perturb_norms(hf)
    as_hf_computes(hf)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, tmp_path)
    return hf, ours, cfg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_hf_across_chunks_and_windows(family, tmp_path):
    hf, ours, cfg = hf_and_ours_of(FAMILIES[family], tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (20,), generator=g).tolist(),
            torch.randint(0, 256, (13,), generator=g).tolist()]
    chunks = [(7, 5), (10, 5), (1, 1), (1, 1), (1, 1)]  # chunked prefill, then decode
    assert_paged_equals_hf(hf, run_paged(ours, cfg, seqs, chunks), seqs, chunks)


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe"])
def test_moe_decode_through_the_layers(family, tmp_path, monkeypatch):
    """The Triton ops (interpreted on the CPU, compiled on a GPU) with moe_decode taking the
    steps of at most 4 tokens (PAGEDSERVE_MOE_DECODE_TOKENS): HF's logits across chunked
    prefill and decode."""
    from pagedserve.kernels import fused_moe as fm

    monkeypatch.setattr(fm, "DECODE_TOKENS", 4)
    decoded = []
    decode = fm.moe_decode
    monkeypatch.setattr(fm, "moe_decode", lambda x, *a, **kw: decoded.append(x.shape[0])
                        or decode(x, *a, **kw))
    hf, _, cfg = hf_and_ours_of(FAMILIES[family], tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = build_model(cfg, get_ops("triton"), torch.float32, torch.device(device), 512,
                       tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 10)]
    chunks = [(7, 5), (4, 3), (1, 1), (1, 1)]  # the last two steps: 2 tokens, moe_decode's
    outs = run_paged(ours, cfg, seqs, chunks, device=device)
    assert_paged_equals_hf(hf, [[o.cpu() for o in per] for per in outs], seqs, chunks)
    assert decoded and set(decoded) == {2}


def test_gpt_oss_without_swiglu_alpha_in_its_config(monkeypatch):
    """The released config.json names swiglu_limit only, and transformers 5.17's config class
    has no swiglu_alpha (its experts hard-code 1.702): such a config loads with HF's 1.702."""
    c = AutoConfig.for_model(**{**FAMILIES["gpt_oss"], "swiglu_limit": 6.0})
    monkeypatch.delattr(type(c), "swiglu_alpha", raising=False)
    c.__dict__.pop("swiglu_alpha", None)
    assert not hasattr(c, "swiglu_alpha")
    moe = ModelConfig.from_hf(c).moe
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 6.0)


def test_gpt_oss_on_the_triton_kernels(tmp_path):
    """gpt-oss's sinks in the paged-attention kernel and its biases and activation in the
    fused-MoE GEMMs (interpreted on the CPU, compiled on a GPU): HF's logits across chunked
    prefill, windows and decode."""
    on_the_triton_kernels("gpt_oss", tmp_path)


def test_latent_attention_on_the_triton_kernels(tmp_path):
    """DeepSeek V3's latent cache (one KV head of kv_lora_rank + rope, read as key and value,
    for every query head) through the paged-attention kernels and the rotary kernel."""
    on_the_triton_kernels("deepseek_v3", tmp_path)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3-v24", "deepseek_v3-32-heads",
                                    "deepseek_v2", "mistral4", "minicpm3"])
def test_latent_prompt_chunks_attend_through_expanded_keys(family, tmp_path, monkeypatch):
    """Prompt chunks of at least LATENT_EXPAND_ROWS tokens (2 here) attend through keys and
    values expanded from their cached latents, beside sequences that stay absorbed in the
    same step (decodes; chunks whose contexts pass the step's budget): HF's logits. Step 1
    expands the first prompt's 7 tokens (8 with its block's padding, of 12) and absorbs the
    second's 5; step 2 expands the second's chunk over its cached 5 and absorbs the first's
    (17 tokens of context: over the 15 of the step, LATENT_EXPAND_TOKENS 0 here)."""
    d = (dict(FAMILIES["deepseek_v3"], v_head_dim=24) if family == "deepseek_v3-v24"
         else FAMILIES[family])
    layers_, expanded = expanded_against_hf(d, 0, tmp_path, monkeypatch)
    assert expanded == [7] * layers_ + [5] * layers_


def test_latent_contexts_expand_up_to_their_token_budget(tmp_path, monkeypatch):
    """With LATENT_EXPAND_TOKENS (64) above the steps' tokens, both prompts' chunks expand in
    each step (one launch of 12 query rows, then 15, a layer): HF's logits."""
    layers_, expanded = expanded_against_hf(FAMILIES["deepseek_v3"], 64, tmp_path,
                                            monkeypatch)
    assert expanded == [12] * layers_ + [15] * layers_


def spy_expanded(monkeypatch) -> list[int]:
    """The query rows of each LatentAttention._expanded call from now on, in order."""
    from pagedserve.executor import layers

    expanded = []
    real = layers.LatentAttention._expanded
    monkeypatch.setattr(layers.LatentAttention, "_expanded", lambda self, q, *a: (
        expanded.append(q.shape[0]), real(self, q, *a))[1])
    return expanded


def expanded_against_hf(d: dict, budget: int, tmp_path, monkeypatch) -> tuple[int, list[int]]:
    """Config d's two prompts in chunks (7 + 5, 10 + 5), then decodes, with
    LATENT_EXPAND_ROWS 2 and LATENT_EXPAND_TOKENS `budget`: HF's logits; (layers, the query
    rows of each expanded launch)."""
    from pagedserve.executor import layers

    monkeypatch.setattr(layers, "LATENT_EXPAND_ROWS", 2)
    monkeypatch.setattr(layers, "LATENT_EXPAND_TOKENS", budget)
    expanded = spy_expanded(monkeypatch)
    hf, ours, cfg = hf_and_ours_of(d, tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (20,), generator=g).tolist(),
            torch.randint(0, 256, (13,), generator=g).tolist()]
    chunks = [(7, 5), (10, 5), (1, 1), (1, 1), (1, 1)]
    assert_paged_equals_hf(hf, run_paged(ours, cfg, seqs, chunks), seqs, chunks)
    return cfg.num_layers, expanded


def test_latent_expanded_prompts_on_the_triton_kernels(tmp_path, monkeypatch):
    """The expanded path's attention (head size nope + rope, one KV head a query head) on
    the paged-attention kernels (interpreted on the CPU, compiled on a GPU)."""
    from pagedserve.executor import layers

    monkeypatch.setattr(layers, "LATENT_EXPAND_ROWS", 2)
    on_the_triton_kernels("deepseek_v3", tmp_path)


def on_the_triton_kernels(family: str, tmp_path) -> None:
    hf, _, cfg = hf_and_ours_of(FAMILIES[family], tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = build_model(cfg, get_ops("triton"), torch.float32, torch.device(device), 512,
                       tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 13)]
    chunks = [(7, 5), (10, 5), (1, 1), (1, 1), (1, 1)]
    outs = run_paged(ours, cfg, seqs, chunks, device=device)
    assert_paged_equals_hf(hf, [[o.cpu() for o in per] for per in outs], seqs, chunks)


def test_windows_follow_the_layer_types(tmp_path):
    cfg = ModelConfig.from_hf(AutoConfig.for_model("gemma2", **TINY, sliding_window=WINDOW))
    assert cfg.layer_windows == (WINDOW, 0)  # Gemma 2 alternates, the first windowed
    cfg = ModelConfig.from_hf(AutoConfig.for_model("mistral", **TINY, sliding_window=WINDOW))
    assert cfg.layer_windows == (WINDOW, WINDOW)
    cfg = ModelConfig.from_hf(AutoConfig.for_model("qwen2", **TINY, sliding_window=WINDOW))
    assert cfg.layer_windows == (0, 0)  # use_sliding_window is off


ROPES = {
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}),
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 128}),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "longrope": ("phi3", {"rope_type": "longrope", "original_max_position_embeddings": 64,
                          "long_factor": [1.0 + i / 4 for i in range(8)],
                          "short_factor": [1.0 + i / 16 for i in range(8)]}),
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_scalings_equal_hf_rotary_embedding(rope):
    model_type, params = ROPES[rope]
    c = AutoConfig.for_model(model_type, **TINY, pad_token_id=0, rope_parameters={
        "rope_theta": 10000.0,
                                                                  **params})
    cfg = ModelConfig.from_hf(c)
    ours = rope_cos_sin_cache(cfg, 512, torch.device("cpu"))
    hf_rope = AutoModelForCausalLM.from_config(c).model.rotary_emb
    half = cfg.head_dim // 2
    # below and above the original length: HF picks LongRoPE's factors per forward pass
    for positions in (torch.arange(0, 60), torch.arange(100, 500)):
        cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
        torch.testing.assert_close(ours[positions, :half], cos[0, :, :half])
        torch.testing.assert_close(ours[positions, half:], sin[0, :, :half])


def test_unsupported_family_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="supported are llama, .*qwen3_moe") as e:
        ModelConfig.from_dict({"model_type": "gpt2"})
    assert "\n" not in str(e.value) and all(f in str(e.value) for f in SUPPORTED)


def test_weights_reach_the_device_in_their_dtype_only(monkeypatch, tmp_path):
    """build_model casts on meta: the device never holds a float32 copy of bf16 weights (a
    Mixtral-8x7B would need 174 GiB for it, twice the card's room for its 87 GiB)."""
    _, _, cfg = hf_and_ours_of(FAMILIES["mixtral"], tmp_path)
    seen = []
    to_empty = torch.nn.Module.to_empty

    def watch(module, *args, **kwargs):
        seen.extend({p.dtype for p in module.parameters()})
        return to_empty(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", watch)
    ours = build_model(cfg, get_ops("torch"), torch.bfloat16, torch.device("cpu"), 64, None)
    assert set(seen) == {torch.bfloat16}
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}


def vision_language_checkpoint(kind: str, tmp_path):
    """A tiny HF vision-language model (vision tower, projector, language model) saved by
    transformers itself; Gemma 3 with Gemma 3 4B's RoPE (linear x8 on its global layers)."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    text = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    if kind == "gemma3":
        text.update(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"],
                    query_pre_attn_scalar=16, rope_parameters={
                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                           "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
        extra = dict(mm_tokens_per_image=4, image_token_index=255, boi_token_index=253,
                     eoi_token_index=254)
    elif kind == "llava":
        text.update(model_type="llama")
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
        extra = dict(image_token_index=255)
    elif kind.startswith("qwen"):  # multimodal RoPE sections, which text turns alike
        text.update(model_type=f"{kind}_text", head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, spatial_merge_size=2, temporal_patch_size=2)
        vision.update(dict(patch_size=14, fullatt_block_indexes=[0], window_size=56)
                      if kind == "qwen2_5_vl" else
                      dict(patch_size=16, deepstack_visual_indexes=[0],
                           num_position_embeddings=16))
        extra = dict(image_token_id=255, video_token_id=254, vision_start_token_id=253)
    elif kind == "exaone4_5":  # EXAONE 4's decoder under Qwen2.5-VL's vision tower
        text.update(model_type="exaone4", head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"])
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, fullatt_block_indexes=[0], window_size=56,
                      num_key_value_heads=2)
        extra = dict(image_token_id=255, video_token_id=254, vision_start_token_id=253)
    else:  # mistral3: tied by the wrapper's flag, or (untied) with a head of its own;
        # Ministral 3's releases: its text model under the same wrapper
        text.update(model_type="mistral", tie_word_embeddings=False)
        if kind in ("mistral3-ministral3", "mistral3-mistral4"):  # (Mistral 4: latent)
            text.update({k: v for k, v in FAMILIES[kind.split("-")[1]].items()
                         if k != "initializer_range"})
        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                      head_dim=16)
        extra = dict(image_token_index=255, tie_word_embeddings=kind == "mistral3")
    config = AutoConfig.for_model(kind.split("-")[0], text_config=text,
                                  vision_config=vision, **extra)
    hf = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("kind", ["gemma3", "mistral3", "mistral3-untied", "mistral3-ministral3",
                                  "mistral3-mistral4", "llava",
                                  "qwen2_5_vl", "qwen3_vl", "exaone4_5"])
def test_a_vision_language_checkpoint_serves_its_language_model(kind, tmp_path):
    """Gemma 3 4B+, Mistral Small 3.1, Ministral 3 and Qwen's VL models ship as
    vision-language models: their language model runs natively, text-only, with HF's logits
    on text; the vision tower is not loaded."""
    hf = vision_language_checkpoint(kind, tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.multimodal == kind.split("-")[0] and cfg.impl == "native"
    assert cfg.tie_word_embeddings == (kind in ("gemma3", "mistral3"))
    ours = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, tmp_path)
    assert not any("vision" in n or "projector" in n for n, _ in ours.named_parameters())
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 250, (22,), generator=g).tolist(),
            torch.randint(0, 250, (11,), generator=g).tolist()]
    chunks = [(7, 5), (13, 4), (1, 1), (1, 1)]  # chunked prefill past the window, decodes
    assert_paged_equals_hf(hf, run_paged(ours, cfg, seqs, chunks), seqs, chunks)


@pytest.mark.parametrize("family,extra", [
    ("glm4-moe", ["model.layers.46.eh_proj.weight",
                  "model.layers.46.mlp.experts.0.gate_proj.weight"]),
    ("ernie4_5_moe", ["mtp_block.0.self_attn.q_proj.weight", "mtp_emb_norm.0.weight"])])
def test_multi_token_prediction_layers_are_skipped_as_hf_skips_them(family, extra, tmp_path):
    """GLM-4.5 ships its MTP layer as model.layers.46 (HF's _keys_to_ignore_on_load_unexpected),
    ERNIE 4.5 as mtp_*: skipped, the decoder equal to the checkpoint without them; any other
    stray tensor is still refused."""
    from safetensors.torch import load_file, save_file

    hf, ours, cfg = hf_and_ours_of(FAMILIES[family], tmp_path)
    (f,) = tmp_path.glob("*.safetensors")
    tensors = load_file(f)
    save_file({**tensors, **{n: torch.ones(4, 4) for n in extra}}, f, metadata={"format": "pt"})
    again = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, tmp_path)
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    save_file({**tensors, "model.layers.0.stray.weight": torch.ones(4)}, f,
              metadata={"format": "pt"})
    with pytest.raises(KeyError, match="unexpected weight layers.0.stray.weight"):
        build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, tmp_path)


def test_a_config_of_a_model_type_transformers_lacks_is_read_by_its_architecture(tmp_path):
    """Kimi K2's config.json says model_type kimi_k2 (remote code, never run here) and names
    DeepseekV3ForCausalLM: it is read as DeepSeek V3's config and served natively."""
    import json

    hf, _, _ = hf_and_ours_of(FAMILIES["deepseek_v3"], tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(model_type="kimi_k2", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.model_type, cfg.impl, cfg.latent.kv_lora_rank) == ("deepseek_v3", "native", 16)
    ours = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 13)]
    chunks = [(7, 5), (12, 7), (1, 1)]
    assert_paged_equals_hf(hf, run_paged(ours, cfg, seqs, chunks), seqs, chunks)
    d.update(architectures=["KimiK2ForCausalLM"])  # nothing transformers has: refused
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="trust_remote_code"):
        ModelConfig.from_pretrained(tmp_path)


def test_many_query_heads_read_the_latent_in_runs_of_sixteen():
    from pagedserve.executor.layers import LATENT_GROUP, LatentAttention

    for heads, splits in ((4, 1), (16, 1), (32, 2), (40, 4), (128, 8)):
        d = {k: v for k, v in FAMILIES["deepseek_v3-32-heads"].items() if k != "model_type"}
        cfg = ModelConfig.from_dict({**TINY, **d, "model_type": "deepseek_v3",
                                     "num_attention_heads": heads,
                                     "num_key_value_heads": heads})
        with torch.device("meta"):
            attn = LatentAttention(cfg, 0, get_ops("torch"))
        assert attn.splits == splits and heads // splits <= LATENT_GROUP
