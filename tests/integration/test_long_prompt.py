"""A 16k-token prompt through the service on the default model, against HF transformers'
greedy tokens (issue 32). That is twice the model's 8,192 positions, which `--max-model-len`
allows (RoPE extends past them as HF's does); the CPU's 2,048-token steps prefill it in eight
chunks, each over the prefix cached before it."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import _serving

PROMPT_LEN = 16_384
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def long_service(tmp_path_factory, model_dir):
    yield from _serving(tmp_path_factory, "long", "--max-model-len", str(PROMPT_LEN + 16))


@pytest.mark.slow
def test_a_16k_token_prompt_gives_hfs_greedy_tokens(long_service, hf_model):
    ids = torch.randint(100, 49_000, (PROMPT_LEN,),
                        generator=torch.Generator().manual_seed(16)).tolist()
    _, got, last = long_service.client.complete(token_ids=ids, max_tokens=NEW_TOKENS,
                                                temperature=0, timeout=900)
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=2)[0, PROMPT_LEN:].tolist()
    assert got == want
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (PROMPT_LEN, NEW_TOKENS)
    m = long_service.wait_idle()
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
