"""FP8 experts (--quantization fp8 of a float checkpoint): each expert quantized per output
channel at load, served within FP8's error of the float model; the refusals."""

import pytest
import torch

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.loader import build_model
from pagedserve.executor.quantization import (
    QuantConfig,
    QuantizationError,
    resolve_quantization,
)
from pagedserve.kernels import get_ops
from pagedserve.kernels.fp8_reference import FP8, quantize_weight
from tests.executor_svc.test_families import FAMILIES, hf_and_ours_of
from tests.executor_svc.test_model import run_paged

SEQS = [list(range(3, 23)), list(range(40, 53))]
CHUNKS = [(7, 5), (10, 5), (1, 1)]


def fp8_model(path, weights=True):
    cfg = ModelConfig.from_pretrained(path)
    quant = resolve_quantization(path, "fp8", random=not weights)
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
    serialized = QuantConfig("fp8", 0, fp8_serialized=True)  # an FP8 checkpoint's experts
    with pytest.raises(QuantizationError, match="experts are served in float or as FP8"):
        build_model(cfg, get_ops("torch"), torch.float32, torch.device("cpu"), 512, None,
                    quant=serialized)
