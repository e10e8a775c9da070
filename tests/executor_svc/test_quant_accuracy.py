"""GPTQ and AWQ lose less than round-to-nearest: the default model's hidden states after its
first two decoder layers, quantized at g128, on the calibration text (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.executor.quantization.pipeline import (
    QuantizeOptions,
    calibration_ids,
    quantize_model,
)
from pagedserve.quantize import DATA

LAYERS = 2


def _hidden(model, ids):
    base = model.model
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        h = base.embed_tokens(ids)
        cos_sin = base.rotary_emb(h, pos)
        for layer in base.layers[:LAYERS]:
            out = layer(h, position_ids=pos, position_embeddings=cos_sin)
            h = out[0] if isinstance(out, tuple) else out
    return h


@pytest.fixture(scope="module")
def ids(tokenizer):
    return calibration_ids(tokenizer, (DATA / "calibration.txt").read_text(), 8, 256)


def test_gptq_and_awq_beat_rtn_on_layer_outputs(model_dir, ids):
    def load():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    ref = _hidden(load(), ids)
    errors = {}
    for method in ("rtn", "awq", "gptq"):
        model = load()
        quantize_model(model, ids, QuantizeOptions(method, 128, layers=LAYERS))
        errors[method] = ((_hidden(model, ids) - ref).norm() / ref.norm()).item()
    assert 0 < errors["gptq"] < errors["rtn"], errors
    assert 0 < errors["awq"] < errors["rtn"], errors
