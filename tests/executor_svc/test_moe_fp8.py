"""FP8 experts (--quantization fp8 of a float checkpoint, or an FP8 checkpoint): each expert
quantized per output channel at load, served within FP8's error of the float model."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.loader import build_model
from pagedserve.executor.quantization import QuantizationError, resolve_quantization
from pagedserve.executor.quantization.fp8 import LINEARS
from pagedserve.kernels import get_ops
from pagedserve.kernels.fp8_reference import FP8, quantize_weight
from tests.executor_svc.test_families import FAMILIES, hf_and_ours_of
from tests.executor_svc.test_model import run_paged

SEQS = [list(range(3, 23)), list(range(40, 53))]
CHUNKS = [(7, 5), (10, 5), (1, 1)]


def fp8_model(path, weights=True, quant=None):
    cfg = ModelConfig.from_pretrained(path)
    quant = quant or resolve_quantization(path, "fp8", random=not weights)
    return build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512,
                       path if weights else None, quant=quant), cfg


@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_fp8_experts_are_each_weight_quantized_and_close_to_float(family, tmp_path):
    hf, ours, cfg = hf_and_ours_of(FAMILIES[family], tmp_path)
    q, _ = fp8_model(tmp_path)
    layer = 0
    moe = q.layers[layer].mlp
    assert moe.w13.dtype == FP8 and moe.w2.dtype == FP8 and moe.w13_scale.dtype == torch.float32
    experts = hf.model.layers[layer].mlp.experts
    gate_up = experts.gate_up_proj  # transformers 5 holds experts stacked: [E, 2I, H]
    for e in range(cfg.moe.num_experts):  # exactly what quantize_weight makes of HF's weights
        want, scale = quantize_weight(gate_up[e].detach())
        assert torch.equal(moe.w13[e].view(torch.uint8), want.view(torch.uint8))
        torch.testing.assert_close(moe.w13_scale[e], scale)
        want, scale = quantize_weight(experts.down_proj[e].detach())
        assert torch.equal(moe.w2[e].view(torch.uint8), want.view(torch.uint8))
        torch.testing.assert_close(moe.w2_scale[e], scale)
    # within FP8's own error of the float model (the dense llama config reads 0.039 here, these
    # 0.04-0.05: every decoder linear is FP8, activations quantized per token)
    for a, b in zip(run_paged(ours, cfg, SEQS, CHUNKS), run_paged(q, cfg, SEQS, CHUNKS),
                    strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x - y).norm() / x.norm() < 0.08


def test_random_fp8_experts_are_drawn(tmp_path):
    hf_and_ours_of(FAMILIES["qwen3-moe"], tmp_path)
    q, _ = fp8_model(tmp_path, weights=False)
    moe = q.layers[1].mlp
    assert moe.w13.float().abs().sum() > 0 and (moe.w13_scale != 1.0).all()


def test_4bit_weights_keep_the_experts_float(tmp_path):
    """--quantization awq of a mixture-of-experts model: the attention 4-bit, the experts
    float (as a 4-bit checkpoint's are served, dequantized at load: test_quant_formats)."""
    hf_and_ours_of(FAMILIES["mixtral"], tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    quant = resolve_quantization(tmp_path, "awq", random=True)
    ours = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, None,
                       quant=quant)
    layer = ours.layers[0]
    assert type(layer.self_attn.qkv_proj).__name__ == "W4Linear"
    assert not layer.mlp.fp8 and layer.mlp.w13.dtype == torch.float32
    assert layer.mlp.w13.abs().sum() > 0


def fp8_moe_checkpoint(d: dict, path, per_tensor_experts: bool):
    """A tiny MoE model as FP8 checkpoints of it are published (vLLM's fp8 method): each
    decoder linear e4m3 with a scale per output channel, each expert's projection a module of
    its own under hub names with a scale per channel or, per_tensor_experts, one per tensor;
    routers float. Also writes path / "float": the values it holds, as a float checkpoint."""
    from safetensors.torch import save_file

    from tests.executor_svc.test_quant_formats import TINY, _hub

    torch.manual_seed(0)
    d = {**TINY, **d}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    mixtral, tensors = hf.config.model_type == "mixtral", {}

    def fp8(module: str, w: torch.Tensor, per_tensor: bool = False) -> torch.Tensor:
        codes, scale = quantize_weight(w)
        if per_tensor:
            scale = scale.max().reshape(())
            codes = (w / scale).clamp(-448, 448).to(FP8)
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"] = codes, scale
        tensors[f"{module}.input_scale"] = torch.tensor(1.0)  # calibration: unused, dynamic
        return codes.float() * scale.reshape(-1)[:, None]

    with torch.no_grad():
        for name, p in hf.state_dict().items():
            module, _, leaf = name.rpartition(".")
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            if leaf == "gate_up_proj":  # [E, 2I, H]
                i = p.shape[1] // 2
                for e in range(p.shape[0]):
                    for rows, proj in ((slice(0, i), names[0]), (slice(i, 2 * i), names[1])):
                        p[e, rows] = fp8(_hub(f"{module}.{e}.{proj}", mixtral), p[e, rows],
                                         per_tensor_experts)
            elif leaf == "down_proj" and module.endswith("experts"):
                for e in range(p.shape[0]):
                    p[e] = fp8(_hub(f"{module}.{e}.{names[2]}", mixtral), p[e],
                               per_tensor_experts)
            elif module.rpartition(".")[2] in LINEARS and leaf == "weight":
                p.copy_(fp8(module, p))
            else:
                tensors[_hub(name, mixtral)] = p.clone()
    hf.save_pretrained(path / "float")
    hf.save_pretrained(path)
    (path / "model.safetensors").unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family,per_tensor", [("qwen2_moe", False), ("mixtral", True)])
def test_an_fp8_moe_checkpoint_serves_as_its_values_quantized_at_load(tmp_path, family,
                                                                      per_tensor):
    """Experts with a scale per channel keep their codes; with one per tensor, each expert is
    quantized again per channel: either way the logits of --quantization fp8 of a float
    checkpoint holding the values the FP8 one holds."""
    from tests.executor_svc.test_quant_formats import MOE

    fp8_moe_checkpoint(MOE[family], tmp_path, per_tensor)
    quant = resolve_quantization(tmp_path)
    assert (quant.method, quant.fp8_serialized) == ("fp8", True)
    got, cfg = fp8_model(tmp_path, quant=quant)
    want, _ = fp8_model(tmp_path / "float")
    assert got.layers[0].mlp.w13.dtype == FP8
    if not per_tensor:  # the checkpoint's own codes
        assert torch.equal(got.layers[0].mlp.w13.view(torch.uint8),
                           want.layers[0].mlp.w13.view(torch.uint8))
    for a, b in zip(run_paged(got, cfg, SEQS, CHUNKS), run_paged(want, cfg, SEQS, CHUNKS),
                    strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_fp8_expert_parts_are_checked(tmp_path):
    from tests.executor_svc.test_quant_formats import MOE

    fp8_moe_checkpoint(MOE["qwen2_moe"], tmp_path, False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(QuantizationError, match=r"experts\.2\.up_proj: checkpoint holds its "
                                                r"weight without the weight_scale"):
        fp8_model(tmp_path, quant=resolve_quantization(tmp_path))


def test_fp8_gpt_oss_keeps_its_biases_and_activation_close_to_float(tmp_path):
    """gpt-oss under --quantization fp8: FP8 experts with float biases beside the clamped
    activation, FP8 attention with its biases; within FP8's own error of the float model."""
    # HF's own init (FAMILIES' wider one makes logits that FP8 moves by 0.1)
    _, ours, cfg = hf_and_ours_of({**FAMILIES["gpt_oss"], "initializer_range": 0.02}, tmp_path)
    q, _ = fp8_model(tmp_path)
    moe = q.layers[0].mlp
    assert moe.fp8 and moe.w13_bias.dtype == torch.float32 and moe.w2_bias.abs().sum() > 0
    for a, b in zip(run_paged(ours, cfg, SEQS, CHUNKS), run_paged(q, cfg, SEQS, CHUNKS),
                    strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x - y).norm() / x.norm() < 0.08


def test_an_mxfp4_gpt_oss_quantized_again_to_fp8(tmp_path):
    """--quantization fp8 of gpt-oss's MXFP4 checkpoint (gpt-oss-120b on one H200): the
    experts dequantized at load, then FP8 per output channel, as a float checkpoint's."""
    from tests.executor_svc.test_hf_fallback import write_mxfp4

    hf, ours, cfg = hf_and_ours_of({**FAMILIES["gpt_oss"], "initializer_range": 0.02},
                                   tmp_path)
    write_mxfp4(hf, tmp_path)
    ours = build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, tmp_path)
    q, _ = fp8_model(tmp_path)
    assert q.layers[0].mlp.fp8 and q.layers[0].mlp.w13.dtype == FP8
    for a, b in zip(run_paged(ours, cfg, SEQS, CHUNKS), run_paged(q, cfg, SEQS, CHUNKS),
                    strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x - y).norm() / x.norm() < 0.08
