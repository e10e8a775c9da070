"""Each native family served end to end by `pagedserve serve --model DIR` from a real HF
checkpoint (a tiny seeded random config written by transformers itself, with the default
model's tokenizer): greedy token ids equal HF transformers' `generate` (fp32, CPU) for
prompts sent one at a time and all at once, longer than the sliding window and than the
step's token budget (chunked prefill), sharing a prefix (prefix-cache hits), in a KV pool
too small for them all (preemption). StarCoder2 has no native module: it runs through the
transformers fallback (--model-impl auto)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.executor_svc.test_families import (
    FAMILIES,
    WINDOW,
    perturb_norms,
    vision_language_checkpoint,
)
from tests.executor_svc.test_hf_fallback import NO_NATIVE
from tests.integration.service import Service

MAX_TOKENS = 12
BUDGET = 32  # tokens a step: the 40-token prompts prefill in two chunks
BLOCKS = 5  # of 16 tokens: one prompt of 40 + 12 tokens needs 4, two at once 7 (a shared one)
ROUNDS = 3  # of the prompts at once, until one has preempted (it depends on how they arrive)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
CONFIGS = {**FAMILIES, **NO_NATIVE}
# every native family but those the model tests cover alike (llama's are the default model's),
# and one served by the transformers fallback (starcoder2: no native module)
SERVED = ["qwen3", "olmo2", "phi3", "gemma2", "gemma3", "granite", "smollm3", "glm4",
          "cohere2", "mixtral", "qwen2-moe", "qwen3-moe", "gpt_oss", "minimax_m2",
          "deepseek_v3", "starcoder2"]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(100, vocab, (20,), generator=g).tolist()
    return [shared + torch.randint(100, vocab, (20,), generator=g).tolist() for _ in range(4)]


def write_checkpoint(family: str, out, model_dir, vocab: int):
    torch.manual_seed(0)
    d = {k: v for k, v in CONFIGS[family].items() if k != "pad_token_id"}
    config = AutoConfig.for_model(d.pop("model_type"), **{**SHAPE, **d}, vocab_size=vocab,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_norms(model)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", SERVED)
def test_family_served_equals_hf_generate(family, tmp_path, model_dir, tokenizer):
    vocab = len(tokenizer)
    hf = write_checkpoint(family, tmp_path / "ckpt", model_dir, vocab)
    ps = prompts(vocab)
    assert len(ps[0]) > WINDOW and len(ps[0]) > BUDGET
    want = []
    for ids in ps:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
        want.append(out[0, len(ids):].tolist())
    svc = Service(tmp_path / "serve.log", "--model", str(tmp_path / "ckpt"),
                  "--max-num-batched-tokens", str(BUDGET), "--num-kv-blocks", str(BLOCKS),
                  "--preemption-mode", "recompute")
    try:
        svc.wait_serving()

        def greedy(ids):
            return svc.client.complete(token_ids=ids, max_tokens=MAX_TOKENS, temperature=0,
                                       ignore_eos=True)[1]

        assert [greedy(ids) for ids in ps] == want  # one at a time: the prefix is cached
        key = 'pagedserve_num_preemptions_total{mode="recompute"}'
        before = svc.metrics().get(key, 0)
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(len(ps)) as pool:
                assert list(pool.map(greedy, ps)) == want  # together: more than the pool holds
            after = svc.wait_idle()
            if after.get(key, 0) > before:
                break
        else:
            raise AssertionError(f"no preemption in {ROUNDS} rounds of the prompts at once")
        assert after["pagedserve_prefix_cache_hits_total"] > 0
        assert after["pagedserve_num_free_kv_blocks"] == after["pagedserve_num_kv_blocks"]
    finally:
        assert svc.stop() == 0, (tmp_path / "serve.log").read_text()[-3000:]


@pytest.mark.slow
def test_a_vision_language_checkpoint_is_served_text_only(tmp_path, model_dir, tokenizer):
    """Gemma 3 as its 4B+ checkpoints ship (Gemma3ForConditionalGeneration, the vision tower
    beside the language model): `serve` reads its text config, context length and EOS and
    answers text prompts with HF's greedy tokens."""
    ckpt = tmp_path / "ckpt"
    hf = vision_language_checkpoint("gemma3", ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, ckpt / f)
    ids = torch.randint(100, 250, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    svc = Service(tmp_path / "serve.log", "--model", str(ckpt))
    try:
        svc.wait_serving()
        got = svc.client.complete(token_ids=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  ignore_eos=True)[1]
        assert got == out[0, len(ids):].tolist()
    finally:
        assert svc.stop() == 0, (tmp_path / "serve.log").read_text()[-3000:]
