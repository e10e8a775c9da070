"""The transformers fallback: HF's own modeling code over the paged KV cache (fp32, CPU)
equals HF transformers itself for families with no native module, and equals the native
module for one that has it."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.core.readiness import EXIT_CONFIG
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.families import UnsupportedModelError
from pagedserve.executor.loader import build_model
from pagedserve.executor.quantization import QuantizationError, resolve_quantization
from pagedserve.executor.quantization.mxfp4 import dequantized_bytes
from pagedserve.kernels import get_ops
from tests.executor_svc.test_model import TINY, assert_paged_equals_hf, run_paged

NO_NATIVE = {
    # LayerNorms with biases, biases on every linear, an MLP without a gate
    "starcoder2": dict(model_type="starcoder2", tie_word_embeddings=False),
    # LayerNorms, a partial rotation, attention beside a dense MLP, a biased LM head
    "phi": dict(model_type="phi", partial_rotary_factor=0.5),
    # no GQA (a config without num_key_value_heads), parallel attention and MLP
    "gpt_neox": dict(model_type="gpt_neox", rotary_pct=0.25, num_key_value_heads=None),
    # learned absolute positions, no rotary
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, num_key_value_heads=None),
}
# native under auto, and through the fallback with --model-impl transformers: multi-head
# latent attention expanded per head (keys of 24, values of 16), HF's own routed experts
LATENT = {
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        moe_intermediate_size=32, n_group=1, topk_group=1,
                        num_key_value_heads=4),
    "deepseek_v2": dict(model_type="deepseek_v2", n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        moe_intermediate_size=32, num_key_value_heads=4),
}
# native now, and through the fallback with --model-impl transformers: attention sinks (a
# per-head logit in the softmax) and sliding windows on alternate layers
GPT_OSS = dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=6)
# what the fallback would get wrong silently, refused at start with the reason
REFUSED = {
    "mamba": (dict(model_type="mamba"), r"layers \[0, 1\] do not attend"),
    "lfm2": (dict(model_type="lfm2", layer_types=["conv", "full_attention"]),
             r"layers \[0\] do not attend .* convolution"),
    "bloom": (dict(model_type="bloom", n_layer=2, n_head=4, num_key_value_heads=None),
              "ALiBi"),
    # every layer attends once, beside a Mamba-2 mixer whose state no paged cache holds
    "falcon_h1": (dict(model_type="falcon_h1", head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                       mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                       mamba_chunk_size=16, mamba_expand=1),
                  "FalconH1Mixer keep a recurrent state between steps"),
    # keys compressed 8:1 beside each layer's own (seen from the probe's 8th token on)
    "deepseek_v4": (dict(model_type="deepseek_v4", num_key_value_heads=1, head_dim=16,
                         q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
                         moe_intermediate_size=32, sliding_window=6, o_groups=2,
                         o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=2,
                         layer_types=["heavily_compressed_attention"] * 2,
                         compress_rates={"compressed_sparse_attention": 4,
                                         "heavily_compressed_attention": 8}),
                    "compressed or extra keys"),
    # Gemma 4's global layers: heads of their own size
    "gemma4_text": (dict(model_type="gemma4_text", head_dim=16, global_head_dim=32,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                         hidden_size_per_layer_input=0),
                    "needs one head size and KV-head count for every layer"),
}
SEQS = [list(range(3, 23)), list(range(40, 53))]
CHUNKS = [(7, 5), (10, 5), (1, 1), (1, 1), (1, 1)]


def saved(d: dict, path):
    torch.manual_seed(0)
    d = dict(d)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"),
                                                               **{**TINY, **d}),
                                          dtype=torch.float32).eval()
    hf.save_pretrained(path)
    return hf


def paged(path, impl: str):
    cfg = ModelConfig.from_pretrained(path, impl)
    model = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, path)
    return run_paged(model, cfg, SEQS, CHUNKS), cfg


@pytest.mark.parametrize("family", sorted(NO_NATIVE) + sorted(LATENT))
def test_fallback_equals_hf_across_chunks(family, tmp_path):
    hf = saved({**NO_NATIVE, **LATENT}[family], tmp_path)
    if family in LATENT:
        assert ModelConfig.from_pretrained(tmp_path, "auto").impl == "native"
    outs, cfg = paged(tmp_path, "transformers" if family in LATENT else "auto")
    assert cfg.impl == "transformers"
    assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)


def test_gpt_oss_through_the_fallback_equals_hf(tmp_path):
    """HF's gpt-oss modeling (--model-impl transformers), its sinks handed to the paged
    attention."""
    hf = saved(GPT_OSS, tmp_path)
    outs, cfg = paged(tmp_path, "transformers")
    assert cfg.impl == "transformers"
    assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)


GRANITE = dict(model_type="granite", embedding_multiplier=2.0, residual_multiplier=0.5,
               attention_multiplier=0.2, logits_scaling=4.0)


@pytest.mark.parametrize("family", ["qwen3", "granite"])
def test_a_native_family_through_the_fallback_equals_native(family, tmp_path):
    """Qwen3 with windows; Granite's multipliers (its logits_scaling applied by the fallback's
    logits)."""
    saved(GRANITE if family == "granite" else dict(
        model_type="qwen3", head_dim=16, sliding_window=6, use_sliding_window=True,
        max_window_layers=0), tmp_path)
    native, cfg = paged(tmp_path, "native")
    if family == "qwen3":
        assert cfg.layer_windows == (6, 6)
    fallback, cfg = paged(tmp_path, "transformers")
    assert cfg.impl == "transformers"
    for a, b in zip(native, fallback, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config,reason", [
    (dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32,
          clip_qkv=0.05), "olmoe: clipped q, k and v"),
    (dict(model_type="llama", hidden_act="gelu"), "llama: activation 'gelu'"),
])
def test_auto_takes_the_fallback_where_the_native_module_lacks_a_switch(config, reason,
                                                                       tmp_path, caplog):
    hf = saved(config, tmp_path)
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelConfig.from_pretrained(tmp_path, "native")
    outs, cfg = paged(tmp_path, "auto")
    assert cfg.impl == "transformers"
    assert reason in caplog.text
    assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)


def test_native_only_refuses_a_family_without_a_module(tmp_path):
    saved(NO_NATIVE["starcoder2"], tmp_path)
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'starcoder2'"):
        ModelConfig.from_pretrained(tmp_path, "native")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_fallback_refuses_what_it_would_get_wrong(family, tmp_path):
    config, reason = REFUSED[family]
    saved(config, tmp_path)
    with pytest.raises(UnsupportedModelError, match=reason):
        paged(tmp_path, "auto")


def test_a_wrappers_sizes_are_its_language_models(tmp_path):
    """A vision-language wrapper with no native module (Gemma 4's, its vision and audio towers
    left out here) is served by the fallback with its text config's sizes; a causal LM that
    transformers' auto mapping lacks (Mistral 4 in 5.25: latent attention, grouped experts)
    is registered from the config's `architectures` (with --model-impl transformers; auto
    serves it natively)."""
    from transformers import AutoConfig

    text = dict(TINY, model_type="gemma4_text", head_dim=16, global_head_dim=16,
                layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                hidden_size_per_layer_input=0, pad_token_id=0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gemma4", text_config=text, vision_config=None, audio_config=None),
        dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "gemma4")
    outs, cfg = paged(tmp_path / "gemma4", "auto")
    assert (cfg.model_type, cfg.impl, cfg.num_layers, cfg.head_dim) == (
        "gemma4", "transformers", TINY["num_hidden_layers"], 16)
    assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)
    from transformers import Mistral4ForCausalLM

    torch.manual_seed(0)
    hf = Mistral4ForCausalLM(AutoConfig.for_model(
        "mistral4", **{**TINY, "num_key_value_heads": 4}, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16)).eval()
    hf.save_pretrained(tmp_path / "mistral4")
    for impl in ("transformers", "auto"):  # (auto: the native module, families.Latent)
        outs, cfg = paged(tmp_path / "mistral4", impl)
        assert cfg.impl == ("native" if impl == "auto" else impl)
        assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)


def test_chunked_attention_is_served_within_one_chunk(tmp_path):
    """Llama 4's chunked local attention (attention_chunk_size) needs a mask the paged
    attention does not apply: the context stops at one chunk (exact within it, equal to HF
    across chunked prefill); a longer --max-model-len is refused at start with the reason."""
    from pagedserve.executor.worker import ExecutorConfig, Worker

    hf = saved(dict(model_type="llama4_text", head_dim=16, attention_chunk_size=32,
                    num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                    interleave_moe_layer_step=1, no_rope_layers=[1, 0]), tmp_path)
    outs, cfg = paged(tmp_path, "auto")
    assert (cfg.impl, cfg.exact_len, cfg.max_position_embeddings) == ("transformers", 32, 32)
    assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)
    with pytest.raises(UnsupportedModelError, match="attends in chunks of 32 tokens .* "
                                                    "--max-model-len at most 32"):
        Worker(ExecutorConfig(model=str(tmp_path), device="cpu", max_model_len=64))


def test_the_fallback_refuses_a_quantized_checkpoint(tmp_path):
    """Block-wise FP8 (which native modules dequantize at load) included."""
    from tests.executor_svc.test_quant_fp8 import write_block_fp8

    write_block_fp8(saved({**NO_NATIVE["starcoder2"], "use_bias": False}, tmp_path), tmp_path,
                    [16, 16])
    with pytest.raises(QuantizationError, match="starcoder2 runs through the transformers "
                                                "fallback, which serves unquantized"):
        paged(tmp_path, "auto")


@pytest.mark.parametrize("model", ["mamba", "hqq"])
def test_the_executor_says_why_in_one_line_and_exits_78(model, tmp_path):
    """A refused model (a state-space model; a quantization it does not read) ends the
    executor with the reason on one line (no traceback) and EXIT_CONFIG, which `serve`'s
    supervisor does not restart."""
    if model == "mamba":
        saved(REFUSED["mamba"][0], tmp_path)
        reason = "mamba: layers [0, 1] do not attend once each"
    else:
        saved(NO_NATIVE["starcoder2"], tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "hqq"}
        (tmp_path / "config.json").write_text(json.dumps(config))
        reason = "quant_method 'hqq' is not supported"
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "executor", "--model",
                           str(tmp_path), "--device", "cpu"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"pagedserve executor: {reason}")


FP4 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., K] -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8, the values
    they hold): OCP MX's FP4 e2m1, two a byte (low nibble first), with one power-of-two scale
    per 32 values stored as exponent + 127, its exponent the block's largest's less 2."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    e = torch.floor(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(1e-30))) - 2
    codes = (g / torch.exp2(e))[..., None].sub(FP4).abs().argmin(-1)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks, (e[..., 0] + 127).to(torch.uint8), (FP4[codes] * torch.exp2(e)).reshape(w.shape)


def write_mxfp4(hf, path) -> None:
    """hf saved as gpt-oss's releases are: each expert projection as `*_blocks` and `*_scales`
    of its [experts, out, in] weight, the rest as it is; hf's experts take the values the
    blocks hold, so hf is the reference for the checkpoint."""
    from safetensors.torch import save_file

    state = {}
    for name, w in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            blocks, scales, values = mxfp4(w.transpose(1, 2).contiguous())
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
            w.copy_(values.transpose(1, 2))
        else:
            state[name] = w.contiguous()
    hf.save_pretrained(path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_checkpoint_is_served_dequantized(tmp_path):
    """gpt-oss's MXFP4 experts, dequantized at load natively (quantization/mxfp4.py) and by
    the fallback (transformers' own), equal HF over the values they hold; the bytes that
    takes are counted from the headers; --quantization other than auto or mxfp4 is refused,
    and another native family's MXFP4 checkpoint is named as the fallback's."""
    hf = saved(GPT_OSS, tmp_path)
    write_mxfp4(hf, tmp_path)
    for requested in ("auto", "mxfp4"):
        assert resolve_quantization(tmp_path, requested) is None
    for impl in ("auto", "transformers"):
        outs, cfg = paged(tmp_path, impl)
        assert cfg.impl == ("native" if impl == "auto" else "transformers")
        assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)
    floats = sum(p.numel() for p in hf.parameters())
    assert dequantized_bytes(tmp_path, torch.bfloat16) == 2 * floats
    for requested, reason in (("none", "is a mxfp4 checkpoint; serve it with --quantization "
                                       "mxfp4 or auto"),
                              ("awq", "--quantization awq, but the checkpoint's "
                                      "quantization_config says 'mxfp4'")):
        with pytest.raises(QuantizationError, match=reason):
            resolve_quantization(tmp_path, requested)
    fp8 = resolve_quantization(tmp_path, "fp8")  # natively: FP8 again; the fallback: refused
    assert fp8 is not None and fp8.method == "fp8" and not fp8.fp8_serialized
    with pytest.raises(QuantizationError, match="serves unquantized and MXFP4 checkpoints"):
        build_model(ModelConfig.from_pretrained(tmp_path, "transformers"), get_ops("torch"),
                    torch.float32, torch.device("cpu"), 512, tmp_path, quant=fp8)
    saved(dict(model_type="qwen3", head_dim=16), tmp_path / "qwen3")
    config = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="qwen3: MXFP4 checkpoints are served through "
                                                "the transformers fallback"):
        paged(tmp_path / "qwen3", "native")
    saved(NO_NATIVE["starcoder2"], tmp_path / "float")
    with pytest.raises(QuantizationError, match="--quantization mxfp4 serves MXFP4"):
        resolve_quantization(tmp_path / "float", "mxfp4")


def test_the_fallback_refuses_tensor_parallelism_as_a_config_error(tmp_path):
    """UnsupportedModelError: the executor ends in one line with exit 78, not a restart."""
    from dataclasses import replace

    saved(NO_NATIVE["starcoder2"], tmp_path)
    cfg = replace(ModelConfig.from_pretrained(tmp_path, "auto"), tp_size=2)
    with pytest.raises(UnsupportedModelError, match="starcoder2: the transformers fallback runs "
                                                    "on one rank: --tensor-parallel-size 1"):
        build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, tmp_path)


def test_mxfp4_blocks_without_their_scales_are_refused():
    from pagedserve.executor.quantization.mxfp4 import dequantize_mxfp4

    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    with pytest.raises(QuantizationError, match="lacks x.experts.down_proj_scales"):
        list(dequantize_mxfp4([("x.experts.down_proj_blocks", blocks)]))
    with pytest.raises(QuantizationError, match="do not match scales"):
        list(dequantize_mxfp4([("x.experts.down_proj_blocks", blocks),
                               ("x.experts.down_proj_scales", torch.zeros(1, 2, 2,
                                                                          dtype=torch.uint8))]))
