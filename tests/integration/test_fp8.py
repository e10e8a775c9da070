"""`--quantization fp8` on the default model, served end to end through gRPC: greedy tokens
equal HF transformers running the same FP8 math (per-channel e4m3 weights dequantized, every
decoder linear's input quantized per token by a forward pre-hook; fp32, CPU)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedserve.protos.v1 import generate_pb2 as api
from tests.integration.conftest import PROMPTS, prompt_ids, request_kwargs
from tests.integration.service import Service

MAX_TOKENS = 16
CASES = [PROMPTS[i] for i in (0, 4)]


@pytest.fixture(scope="module")
def reference_greedy(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from tests.executor_svc.test_quant_fp8 import fp8_math_hooks

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fp8_math_hooks(model)
    outs = []
    for kind, content in CASES:
        ids = prompt_ids(tokenizer, kind, content)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=2)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def test_fp8_service_answers_like_the_fp8_math(tmp_path, reference_greedy):
    svc = Service(tmp_path / "serve.log", "--quantization", "fp8",
                  "--max-num-batched-tokens", "64")
    try:
        svc.wait_serving()
        with ThreadPoolExecutor(len(CASES)) as pool:
            got = list(pool.map(lambda p: svc.client.complete(
                **request_kwargs(*p), max_tokens=MAX_TOKENS, temperature=0, timeout=300), CASES))
    finally:
        assert svc.stop() == 0
    assert [ids for _, ids, _ in got] == reference_greedy
    assert "Paris" in got[0][0]
    assert all(last.finish_reason in (api.FINISH_REASON_LENGTH, api.FINISH_REASON_STOP)
               for _, _, last in got)
    assert "fp8 e4m3 (quantized at load), per-token activation scales" in \
        (tmp_path / "serve.log").read_text()
