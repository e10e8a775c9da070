"""FP8 weights in the model: quantized at load, and checkpoints in each published format
(quant_method fp8 with per-tensor or per-channel scales, compressed-tensors float8, static
activation scales) against HF transformers running the same quantized math (dequantized
weights, inputs of every decoder linear quantized and dequantized by forward pre-hooks);
refusals with their reasons."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.executor.checkpoint import iter_checkpoint
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.loader import build_model
from pagedserve.executor.quantization import QuantizationError, resolve_quantization
from pagedserve.executor.quantization.fp8 import LINEARS
from pagedserve.kernels import get_ops
from pagedserve.kernels.fp8_reference import FP8, FP8_MAX, quantize_input, quantize_weight
from tests.executor_svc.test_model import run_paged

OPS = get_ops("torch")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
SEQ = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()


def float_model(path, equal_row_amax=False):
    """A random tiny Llama saved in fp32. equal_row_amax: every row of a decoder linear has one
    amax, so a per-tensor scale is each row's per-channel scale (same codes both ways)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY),
                                          dtype=torch.float32).eval()
    if equal_row_amax:
        with torch.no_grad():
            for name, mod in hf.named_modules():
                if name.rpartition(".")[2] in LINEARS:
                    w, top = mod.weight, mod.weight.abs().amax()
                    w.mul_(top / w.abs().amax(1, keepdim=True))
                    peak = w.abs().argmax(1)  # exactly top, not within rounding of it
                    rows = torch.arange(w.shape[0])
                    w[rows, peak] = w[rows, peak].sign() * top
    hf.save_pretrained(path)
    return hf


def linears(hf):
    return {n: m for n, m in hf.named_modules() if n.rpartition(".")[2] in LINEARS}


def write_fp8(hf, path, qc, per_tensor=False, column_scale=False, input_scales=None):
    """hf's weights as an FP8 checkpoint: e4m3 weights, weight_scale [] (per tensor) or [N]
    ([N, 1] with column_scale, compressed-tensors' shape), input_scale [] per module."""
    tensors = {}
    for name, t in hf.state_dict().items():
        module = name.rpartition(".")[0]
        if module.rpartition(".")[2] not in LINEARS:
            tensors[name] = t.contiguous()
            continue
        codes, scale = quantize_weight(t)
        if per_tensor:
            scale = scale.max().reshape(())
            codes = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        elif column_scale:
            scale = scale[:, None]
        tensors[name] = codes.contiguous()
        tensors[f"{module}.weight_scale"] = scale.contiguous()
        if input_scales is not None:
            tensors[f"{module}.input_scale"] = torch.tensor(input_scales[module])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return path


def ct_config(channel: bool, static: bool) -> dict:
    """compressed-tensors' float8 config as llm-compressor writes it (FP8 / FP8_DYNAMIC)."""
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts,
                                          "weights": {"num_bits": 8, "type": "float",
                                                      "symmetric": True, "dynamic": False,
                                                      "strategy": "channel" if channel
                                                      else "tensor"}}}}


def fp8_math_hooks(hf, static_scales=None) -> list:
    """Make HF run the FP8 math: per-channel quantized weights (dequantized), each decoder
    linear's input quantized per token (or with the largest static scale of its input's
    readers, q/k/v and gate/up sharing one). Returns the hooks."""
    hooks = []
    with torch.no_grad():
        for name, mod in linears(hf).items():
            codes, scale = quantize_weight(mod.weight)
            mod.weight.copy_(codes.float() * scale[:, None])
            s = None
            if static_scales is not None:
                prefix = name.rpartition(".")[0]
                readers = [v for k, v in static_scales.items() if k.rpartition(".")[0] == prefix
                           and _reads_same(k, name)]
                s = torch.tensor([max(readers)])

            def hook(_m, args, s=s):
                x = args[0]
                xq, sa = quantize_input(x.reshape(-1, x.shape[-1]), s)
                return ((xq.float() * sa).reshape(x.shape),)

            hooks.append(mod.register_forward_pre_hook(hook))
    return hooks


def hf_fp8_logits(hf, static_scales=None) -> torch.Tensor:
    hooks = fp8_math_hooks(hf, static_scales)
    with torch.no_grad():
        logits = hf(torch.tensor([SEQ])).logits[0, -1]
    for h in hooks:
        h.remove()
    return logits


def _reads_same(a: str, b: str) -> bool:
    groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    pa, pb = a.rpartition(".")[2], b.rpartition(".")[2]
    return pa == pb or any(pa in g and pb in g for g in groups)


def ours(path, requested="auto", dtype=torch.float32):
    quant = resolve_quantization(path, requested)
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, OPS, dtype, torch.device("cpu"), 128, path, quant=quant)
    return model, run_paged(model, cfg, [SEQ], [(8,), (4,)], dtype=dtype)[0][-1]


def test_quantized_at_load_matches_hf_running_the_fp8_math(tmp_path):
    hf = float_model(tmp_path)
    model, logits = ours(tmp_path, "fp8")
    qkv = model.layers[0].self_attn.qkv_proj
    assert (qkv.weight.dtype, qkv.weight_scale.dtype, qkv.weight_scale.shape) == \
        (FP8, torch.float32, (128,))
    assert qkv.input_scale is None
    torch.testing.assert_close(logits, hf_fp8_logits(hf), rtol=1e-4, atol=1e-4)
    fp = ours(tmp_path, "none")[1]
    assert 1e-3 < (logits - fp).abs().max() < 0.1  # quantized: near the float model, not it


def test_latent_attention_quantized_at_load(tmp_path):
    """Youtu's latent attention (q straight from the hidden state) with --quantization fp8:
    q_proj, o_proj and the MLP in FP8, the latent's projections float, as HF running that
    math; a 4-bit or FP8 checkpoint's latent attention is refused."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "youtu", **{**TINY, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, tie_word_embeddings=False),
        dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    model, logits = ours(tmp_path, "fp8")
    attn = model.layers[0].self_attn
    assert (attn.q_proj.weight.dtype, attn.o_proj.weight.dtype,
            attn.kv_b_proj.weight.dtype) == (FP8, FP8, torch.float32)
    torch.testing.assert_close(logits, hf_fp8_logits(hf), rtol=1e-4, atol=1e-4)
    write_fp8(hf, tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(QuantizationError, match="latent attention takes float weights"):
        ours(tmp_path)


def test_fused_projections_quantized_at_load(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj (with partial rotary embeddings, as
    Phi-4-mini's) quantized per output channel as the parts they are split into: HF running
    the FP8 math on the fused modules."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "phi3", pad_token_id=0, partial_rotary_factor=0.75, **TINY), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    assert "model.layers.0.self_attn.qkv_proj" in linears(hf)
    model, logits = ours(tmp_path, "fp8")
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    torch.testing.assert_close(logits, hf_fp8_logits(hf), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["fp8-channel", "ct-channel"])
def test_per_channel_checkpoint_equals_quantizing_at_load(tmp_path, fmt):
    hf = float_model(tmp_path / "float")
    want = ours(tmp_path / "float", "fp8")[1]
    qdir = tmp_path / "float"
    qc = ({"quant_method": "fp8", "activation_scheme": "dynamic"} if fmt == "fp8-channel"
          else ct_config(channel=True, static=False))
    write_fp8(hf, qdir, qc, column_scale=fmt == "ct-channel")
    quant = resolve_quantization(qdir)
    assert (quant.method, quant.fp8_serialized, quant.static_activations) == ("fp8", True, False)
    assert torch.equal(ours(qdir)[1], want)


@pytest.mark.parametrize("fmt", ["fp8", "ct"])
def test_per_tensor_checkpoint_equals_quantizing_at_load(tmp_path, fmt):
    # rows of equal amax: per-tensor and per-channel quantization give the same codes and
    # scales, and each of q/k/v (gate/up) has its own per-tensor scale, copied to its rows
    hf = float_model(tmp_path, equal_row_amax=True)
    want = ours(tmp_path, "fp8")[1]
    scales = {n: m.weight.abs().amax().item() for n, m in linears(hf).items()}
    assert len({scales["model.layers.0.self_attn.q_proj"],
                scales["model.layers.0.self_attn.k_proj"]}) == 2
    qc = ({"quant_method": "fp8", "activation_scheme": "dynamic"} if fmt == "fp8"
          else ct_config(channel=False, static=False))
    write_fp8(hf, tmp_path, qc, per_tensor=True)
    assert torch.equal(ours(tmp_path)[1], want)


@pytest.mark.parametrize("fmt", ["fp8", "ct"])
def test_static_activation_scales_take_the_largest_of_fused_parts(tmp_path, fmt):
    hf = float_model(tmp_path)
    g = torch.Generator().manual_seed(5)
    # a scale of about amax / 448 of the inputs, different for each part
    inputs = {n: 0.004 + 0.004 * torch.rand((), generator=g).item() for n in linears(hf)}
    qc = ({"quant_method": "fp8", "activation_scheme": "static"} if fmt == "fp8"
          else ct_config(channel=True, static=True))
    write_fp8(hf, tmp_path, qc, column_scale=fmt == "ct", input_scales=inputs)
    model, logits = ours(tmp_path)
    qkv = model.layers[1].self_attn.qkv_proj
    want_qkv = max(inputs[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv")
    assert qkv.input_scale.tolist() == [pytest.approx(want_qkv)]
    torch.testing.assert_close(logits, hf_fp8_logits(hf, inputs), rtol=1e-4, atol=1e-4)


def test_bf16_model_holds_fp8_codes_and_float32_scales(tmp_path):
    float_model(tmp_path)
    model, logits = ours(tmp_path, "fp8", dtype=torch.bfloat16)
    down = model.layers[0].mlp.down_proj
    assert (down.weight.dtype, down.weight_scale.dtype) == (FP8, torch.float32)
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    fp8_bytes = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    bf16 = build_model(ModelConfig.from_pretrained(tmp_path), OPS, torch.bfloat16,
                       torch.device("cpu"), 128, tmp_path)
    bf16_bytes = sum(p.numel() * p.element_size() for p in bf16.layers.parameters())
    assert fp8_bytes < 0.53 * bf16_bytes  # 1 byte a weight plus 4 per output channel
    assert torch.isfinite(logits).all()


def test_random_fp8_weights(tmp_path):
    float_model(tmp_path)
    quant = resolve_quantization(tmp_path, "fp8", random=True)
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = build_model(cfg, OPS, torch.float32, torch.device("cpu"), 64, None, quant=quant)
    lin = model.layers[0].mlp.gate_up_proj
    w = lin.weight.float() * lin.weight_scale[:, None]
    assert lin.weight.float().abs().amax(1).eq(448).all()
    assert 0.015 < w.std().item() < 0.025
    logits = run_paged(model, cfg, [[1, 2, 3, 4]], [(4,)])[0][-1]
    assert logits.shape == (256,) and torch.isfinite(logits).all()


def _config(tmp_path, qc):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, model_type="llama",
                                                          quantization_config=qc)))
    return tmp_path


def write_block_fp8(hf, path, block) -> dict[str, torch.Tensor]:
    """hf's decoder linears as a block-wise FP8 checkpoint (Qwen3's FP8 releases' layout:
    e4m3 weight, weight_scale_inv [ceil(N / rows), ceil(K / columns)], one amax / 448 a
    block); returns the dequantized weights."""
    tensors, dequantized = {}, {}
    for name, t in hf.state_dict().items():
        module = name.rpartition(".")[0]
        if module.rpartition(".")[2] not in LINEARS:
            tensors[name] = t.contiguous()
            continue
        rows, cols = t.shape
        pad = torch.zeros(-(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1])
        pad[:rows, :cols] = t.abs()
        amax = pad.reshape(pad.shape[0] // block[0], block[0], -1, block[1]).amax((1, 3))
        scale = amax / FP8_MAX
        wide = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)
        codes = (t / wide[:, :cols]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[name], tensors[f"{module}.weight_scale_inv"] = codes, scale
        dequantized[name] = codes.float() * wide[:, :cols]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": block}
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.mark.parametrize("block", [[128, 128], [16, 48]])
def test_block_wise_fp8_is_served_dequantized(tmp_path, block):
    """Blocks wider than the weight (128 over 64 columns) and not dividing it (48): served in
    float by default, equal to HF running the dequantized weights; with --quantization fp8
    quantized again per output channel."""
    hf = float_model(tmp_path)
    dequantized = write_block_fp8(hf, tmp_path, block)
    hf.load_state_dict(dequantized, strict=False)
    with torch.no_grad():
        want = hf(torch.tensor([SEQ])).logits[0, -1]
    assert resolve_quantization(tmp_path) is None
    _, got = ours(tmp_path)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    model, _ = ours(tmp_path, "fp8")
    lin = model.layers[0].mlp.down_proj
    codes, scale = quantize_weight(dequantized["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(lin.weight.view(torch.uint8), codes.view(torch.uint8))
    torch.testing.assert_close(lin.weight_scale, scale)


@pytest.mark.parametrize("qc,requested,match", [
    ({"quant_method": "fp8", "weight_block_size": [128]}, "auto", "not two positive ints"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "auto",
     "'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "auto", "'sometimes'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "auto", "'e5m2'"),
    ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]}, "auto",
     "float layers"),
    ({"quant_method": "fp8"}, "none", "--quantization fp8"),
    ({"quant_method": "fp8"}, "gptq", "says 'fp8'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "fp8", "says 'awq'"),
    ({**ct_config(True, False), "format": "pack-quantized"}, "auto",
     "pack-quantized weights type 'float' num_bits 8"),
    ({**ct_config(True, False), "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "auto",
     "type 'int'"),
    ({**ct_config(True, False), "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}, "auto",
     "weight-only"),
    ({**ct_config(True, False), "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}, "auto",
     "strategy 'block'"),
    ({**ct_config(True, False), "config_groups": {}}, "auto", "config_groups is empty"),
])
def test_invalid_fp8_configs_are_refused_with_reason(tmp_path, qc, requested, match):
    with pytest.raises(QuantizationError, match=match):
        resolve_quantization(_config(tmp_path, qc), requested)


def test_checkpoint_tensors_are_checked(tmp_path):
    hf = float_model(tmp_path)
    write_fp8(hf, tmp_path, {"quant_method": "fp8"})
    tensors = dict(iter_checkpoint(tmp_path))
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({**tensors, name: tensors[name].float().bfloat16()}, tmp_path / "model.safetensors")
    with pytest.raises(QuantizationError, match=f"{name} is torch.bfloat16; an FP8 checkpoint"):
        ours(tmp_path)
    del tensors["model.layers.0.self_attn.o_proj.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(QuantizationError,
                       match="model.layers.0.self_attn.o_proj: checkpoint lacks weight_scale"):
        ours(tmp_path)
    write_fp8(hf, tmp_path, {"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(QuantizationError, match="lacks input_scale"):
        ours(tmp_path)
