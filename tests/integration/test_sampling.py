"""Penalties, filters, logprobs and n through the running service, against HF transformers
(fp32 CPU, the default model): greedy output with each feature equals HF `generate` with the
matching logits processors, token for token; logprobs equal HF's log_softmax within 1e-4."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedserve.protos.v1 import generate_pb2 as api
from tests.hf_processors import processors
from tests.integration.conftest import LONG_TEXT, PROMPTS, prompt_ids, request_kwargs

MAX_TOKENS = 24
CHOSEN = [PROMPTS[i] for i in (0, 4)]  # one raw, one chat (which ends early with EOS)
CASES = {
    "repetition": {"repetition_penalty": 1.3},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.0},
    "logit_bias": {"logit_bias": "ban the first greedy token, favour the third"},
    "min_tokens": {"min_tokens": 16},
    "all": {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3,
            "min_tokens": 12},
}


@pytest.fixture(scope="module")
def eos_ids(service):
    return tuple(service.client.model_info().eos_token_ids)


def hf_generate(model, ids, tokenizer, procs, max_tokens=MAX_TOKENS):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             logits_processor=procs, pad_token_id=tokenizer.pad_token_id or 2)
    return out[0, len(ids):].tolist()


def case_kwargs(case, ids, plain):
    kw = dict(CASES[case])
    if "logit_bias" in kw:
        kw["logit_bias"] = {plain[0]: -100.0, plain[2]: 5.0}
    return kw


_PLAIN: dict[tuple[str, str], list[int]] = {}  # HF greedy output of each prompt, computed once


def expected(case, kind_content, tokenizer, hf_model, eos_ids):
    ids = prompt_ids(tokenizer, *kind_content)
    if kind_content not in _PLAIN:
        _PLAIN[kind_content] = hf_generate(hf_model, ids, tokenizer, processors(len(ids)))
    plain = _PLAIN[kind_content]
    kw = case_kwargs(case, ids, plain)
    procs = processors(len(ids), masked_ids=eos_ids, **kw)
    return kw, plain, hf_generate(hf_model, ids, tokenizer, procs)


def complete(svc, kind_content, **kw):
    return svc.client.complete(**request_kwargs(*kind_content), max_tokens=MAX_TOKENS,
                               temperature=0, timeout=300, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_each_feature_equals_hf_generate(case, service, tokenizer, hf_model,
                                                     eos_ids):
    """The prompts run together (so a penalized row shares batches with others); each
    equals HF with the matching processors, and the feature changed at least one output
    (else the test could not tell a request whose parameter was dropped)."""
    refs = [expected(case, p, tokenizer, hf_model, eos_ids) for p in CHOSEN]
    with ThreadPoolExecutor(len(CHOSEN)) as pool:
        got = list(pool.map(lambda a: complete(service, a[0], **a[1][0]), zip(CHOSEN, refs,
                                                                           strict=True)))
    for (_, ids, last), (kw, _, ref), p in zip(got, refs, CHOSEN, strict=True):
        assert ids == ref, f"{case}, prompt {p[1][:30]!r}"
        if "min_tokens" in kw:
            assert len(ids) >= kw["min_tokens"]
        want = (api.FINISH_REASON_STOP if ref[-1] in eos_ids else api.FINISH_REASON_LENGTH)
        assert last.finish_reason == want
    assert any(ref != plain for _, plain, ref in refs), f"{case} changed nothing"


def test_min_tokens_holds_back_a_stop_string(service):
    """'Paris' stops the plain answer within a few tokens; with min_tokens 12 the text before
    the 12th token is not searched: 'Paris' stays in the text and the output is that of
    min_tokens alone, up to where it stops."""
    chat = ("chat", "What is the capital of France?")
    _, ids, last = complete(service, chat, stop=["Paris"])
    assert last.stop_string == "Paris" and len(ids) < 12
    _, base, _ = complete(service, chat, min_tokens=12)
    text, ids, _ = complete(service, chat, stop=["Paris"], min_tokens=12)
    assert "Paris" in text and len(ids) >= 12 and ids == base[:len(ids)]


def test_penalized_outputs_survive_preemption(tight_service, service):
    """Recompute rebuilds a preempted request's counts from its token ids: the 8 prompts at once
    on 10 KV blocks, with penalties, give what the same requests give unpreempted on the main
    service (whose penalized outputs equal HF's above; batches keep a request's tokens)."""
    kw = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3,
          "min_tokens": 4}

    def run(svc):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(lambda p: complete(svc, p, **kw)[1], PROMPTS))

    refs = run(service)  # 1,456 blocks: no preemption there
    key = 'pagedserve_num_preemptions_total{mode="recompute"}'
    before = tight_service.metrics()[key]
    for _ in range(3):
        assert run(tight_service) == refs
        m = tight_service.wait_idle()
        if m[key] > before:
            assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
            return
    raise AssertionError("no preemption in 3 rounds")


def hf_logprobs(model, ids, out):
    """log_softmax of HF's fp32 logits at each generated position: [len(out), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_equal_hf_log_softmax(service, tokenizer, hf_model):
    for p, k in ((PROMPTS[0], 5), (PROMPTS[4], 0), (PROMPTS[2], 20)):
        ids = prompt_ids(tokenizer, *p)
        got_ids, entries = [], []
        for r in service.client.generate(**request_kwargs(*p), max_tokens=12, temperature=0,
                                         logprobs=k, timeout=300):
            got_ids.extend(r.token_ids)
            entries.extend(r.logprobs)
        assert [e.token_id for e in entries] == got_ids and len(got_ids) > 0
        ref = hf_logprobs(hf_model, ids, got_ids)
        for i, e in enumerate(entries):
            assert abs(e.logprob - ref[i, e.token_id].item()) < 1e-4
            top = ref[i].topk(k)
            assert list(e.top_token_ids) == top.indices.tolist()
            assert max((abs(a - b) for a, b in zip(e.top_logprobs, top.values.tolist(),
                                                   strict=True)), default=0) < 1e-4


def test_logprobs_are_absent_unless_asked(service):
    for r in service.client.generate(text="Hello", max_tokens=4, temperature=0, timeout=300):
        assert len(r.logprobs) == 0


def completions(svc, n, **kw):
    """{index: (token ids, last response)} of one n-completion call, and every response."""
    out, responses = {}, []
    for r in svc.client.generate(n=n, timeout=300, **kw):
        responses.append(r)
        ids, _ = out.get(r.index, ([], None))
        out[r.index] = (ids + list(r.token_ids), r)
    return out, responses


def test_n_seeded_completions_differ_and_reproduce(service):
    kw = dict(chat=[("user", "Tell me a story about a cat.")], max_tokens=16, temperature=1.0,
              seed=42)
    first, responses = completions(service, 3, **kw)
    again, _ = completions(service, 3, **kw)
    assert sorted(first) == [0, 1, 2]
    assert {i: ids for i, (ids, _) in first.items()} == {i: ids for i, (ids, _) in again.items()}
    assert len({tuple(ids) for ids, _ in first.values()}) == 3
    # completion 0 uses the seed itself: it is the n = 1 request's output
    _, alone, _ = service.client.complete(**kw, timeout=300)
    assert first[0][0] == alone
    finals = [r for r in responses if r.finish_reason]
    assert sorted(r.index for r in finals) == [0, 1, 2]  # each ends once, the call after all
    assert responses[-1].finish_reason and all(r.usage.completion_tokens == 16 for r in finals)


def test_greedy_n_gives_identical_hf_outputs_and_computes_the_prompt_once(service, tokenizer,
                                                                           hf_model):
    """A long prompt no other test sends (prefilled in chunks at the service's budget of 64):
    completion 1 finds all of completion 0's full prompt blocks in the prefix cache."""
    text = "First read this, then answer in French. " + LONG_TEXT  # no cached prefix
    ids = tokenizer.encode(text)
    ref = hf_generate(hf_model, ids, tokenizer, processors(len(ids)))
    before = service.metrics()
    out, _ = completions(service, 2, text=text, max_tokens=MAX_TOKENS, temperature=0)
    assert out[0][0] == out[1][0] == ref
    m = service.wait_idle()
    hits = m["pagedserve_prefix_cache_hits_total"] - before["pagedserve_prefix_cache_hits_total"]
    assert hits == (len(ids) - 1) // 16 * 16


def test_cancelling_n_completions_midway_frees_every_block(service):
    stream = service.client.generate(n=3, text="Count from one to a hundred:", max_tokens=200,
                                     temperature=1.0, ignore_eos=True, timeout=300)
    seen = set()
    for r in stream:
        seen.add(r.index)
        if len(seen) == 3:
            break
    stream.close()
    m = service.wait_idle()
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
    assert m["pagedserve_num_requests_running"] == 0


def test_async_scheduling_gives_the_same_penalized_outputs_and_logprobs(sync_service, service):
    """With async scheduling (the default) the executor samples step N+1 before N's tokens
    reach the scheduler: the counts it keeps must still include N's token."""
    kw = {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "min_tokens": 10, "logprobs": 2}

    def run(svc):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(lambda p: [(list(r.token_ids), [(e.token_id, list(
                e.top_token_ids)) for e in r.logprobs]) for r in svc.client.generate(
                **request_kwargs(*p), max_tokens=MAX_TOKENS, temperature=0, timeout=300, **kw)],
                PROMPTS))

    def flat(outs):
        return [([t for ids, _ in o for t in ids], [e for _, lps in o for e in lps])
                for o in outs]

    assert flat(run(sync_service)) == flat(run(service))


def hf_prompt_logprobs(model, ids):
    """log_softmax of HF's fp32 logits scoring prompt tokens 1..: [len(ids) - 1, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def prompt_logprobs(svc, k, **kw):
    """(entries of the one response that has them, responses that had them)."""
    got = [list(r.prompt_logprobs) for r in svc.client.generate(
        prompt_logprobs=k, max_tokens=2, temperature=0, timeout=300, **kw)]
    return got[0], sum(1 for g in got if g)


def assert_prompt_logprobs_equal_hf(entries, ids, ref, k):
    assert [e.token_id for e in entries] == ids[1:]  # none for the first prompt token
    for i, e in enumerate(entries):
        want = ref[i, ids[i + 1]].item()
        assert abs(e.logprob - want) < 1e-4
        assert e.rank == int((ref[i] >= want).sum())  # vLLM's rank: 1 = most likely
        top = ref[i].topk(k)
        assert list(e.top_token_ids) == top.indices.tolist()
        assert max((abs(a - b) for a, b in zip(e.top_logprobs, top.values.tolist(),
                                               strict=True)), default=0) < 1e-4


def test_prompt_logprobs_equal_hf_over_chunks_and_a_warm_prefix_cache(service, tokenizer,
                                                                      hf_model):
    """A prompt several prefill chunks long (the service's budget is 64 tokens), sent twice:
    the second time its blocks are in the prefix cache, which a request asking for prompt
    logprobs does not read (its usage shows none cached)."""
    text = "Score every word of this. " + LONG_TEXT
    ids = tokenizer.encode(text)
    assert len(ids) > 64  # at least two chunks
    ref = hf_prompt_logprobs(hf_model, ids)
    for k in (5, 0):  # the second run: the cache is warm from the first
        entries, responses_with = prompt_logprobs(service, k, text=text)
        assert responses_with == 1  # sent once, on the first response
        assert_prompt_logprobs_equal_hf(entries, ids, ref, k)
    m = service.wait_idle()
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]


def test_prompt_logprobs_with_n_come_once_and_short_prompts(service, tokenizer, hf_model):
    ids = tokenizer.encode("The capital of France is")
    ref = hf_prompt_logprobs(hf_model, ids)
    got = [r for r in service.client.generate(text="The capital of France is", n=3,
                                              prompt_logprobs=2, max_tokens=3, timeout=300,
                                              temperature=1.0, seed=7)]
    with_them = [r for r in got if r.prompt_logprobs]
    assert len(with_them) == 1 and with_them[0].index == 0
    assert_prompt_logprobs_equal_hf(list(with_them[0].prompt_logprobs), ids, ref, 2)
    one = [list(r.prompt_logprobs) for r in service.client.generate(
        token_ids=[ids[0]], prompt_logprobs=3, max_tokens=2, temperature=0, ignore_eos=True,
        timeout=300)]
    assert one == [[], []]  # one prompt token: nothing to score


@pytest.mark.parametrize("k", [-1, 21])
def test_prompt_logprobs_out_of_range_are_invalid(service, k):
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        list(service.client.generate(text="hi", prompt_logprobs=k, max_tokens=2, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"sampling.prompt_logprobs: must be in [0, 20], got {k}"
