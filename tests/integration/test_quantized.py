"""A 4-bit g128 checkpoint of the default model in GPTQ's format, made by `pagedserve quantize`,
served end to end: greedy tokens equal HF transformers running the same checkpoint
dequantized into a float model by this file's own unpacker (fp32, CPU).

It is made with --method rtn, which writes the same format as gptq in a tenth of the time (the
CI budget); GPTQ act-order and AWQ checkpoints are checked against HF through the model in
tests/executor_svc/test_quant_formats.py."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.conftest import PROMPTS, prompt_ids, request_kwargs
from tests.integration.service import Service

MAX_TOKENS = 16
CASES = [PROMPTS[i] for i in (0, 2, 4, 6)]


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("gptq")
    subprocess.run([sys.executable, "-m", "pagedserve.cli", "quantize", "--model", str(model_dir),
                    "--method", "rtn", "--group-size", "128", "--out", str(out)], check=True)
    return out


def dequantized_state(qdir):
    """GPTQ v1 tensors -> float weights: W[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) * s."""
    qc = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["checkpoint_format"]) == ("gptq", 4, "gptq")
    tensors = load_file(qdir / "model.safetensors")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    state = {}
    for name, t in tensors.items():
        module, _, part = name.rpartition(".")
        if part in ("qzeros", "scales", "g_idx"):
            continue
        if part != "qweight":
            state[name] = t
            continue
        q = ((t[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, t.shape[1])  # [K, N]
        qz = tensors[f"{module}.qzeros"]
        z = ((qz[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(qz.shape[0], -1) + 1
        g = tensors[f"{module}.g_idx"].long()
        s = tensors[f"{module}.scales"].float()
        state[f"{module}.weight"] = ((q.float() - z[g].float()) * s[g]).t().contiguous()
    return state


@pytest.fixture(scope="module")
def reference_greedy(quant_dir, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((quant_dir / "config.json").read_text())
    del config["quantization_config"]
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(dequantized_state(quant_dir), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    outs = []
    for kind, content in CASES:
        ids = prompt_ids(tokenizer, kind, content)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=2)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def test_served_checkpoint_matches_dequantized_reference(tmp_path, quant_dir,
                                                              reference_greedy):
    svc = Service(tmp_path / "serve.log", "--model", str(quant_dir), "--quantization", "auto",
                  "--max-num-batched-tokens", "64")
    try:
        svc.wait_serving()

        def one(p):
            return svc.client.complete(**request_kwargs(*p), max_tokens=MAX_TOKENS,
                                       temperature=0, timeout=300)[1]

        with ThreadPoolExecutor(len(CASES)) as pool:
            got = list(pool.map(one, CASES))
    finally:
        assert svc.stop() == 0
    assert got == reference_greedy
