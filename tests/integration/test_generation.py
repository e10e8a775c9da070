"""The whole service (two processes) against HF transformers greedy output, token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.client import stop_reason
from pagedserve.protos.v1 import generate_pb2 as api
from tests.integration.conftest import BUDGET, MAX_TOKENS, PROMPTS, prompt_ids, request_kwargs


def run_all(service, concurrently: bool, **extra):
    def one(p):
        text, ids, last = service.client.complete(**request_kwargs(*p), max_tokens=MAX_TOKENS,
                                                  temperature=0, timeout=300, **extra)
        return ids, text, last

    if not concurrently:
        return [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def check_against_hf(results, hf_greedy, tokenizer):
    for (ids, text, last), ref, prompt in zip(results, hf_greedy, PROMPTS, strict=True):
        assert ids == ref, f"prompt {prompt[1][:40]!r}"
        assert text == tokenizer.decode(ref, skip_special_tokens=True)
        assert last.usage.prompt_tokens == len(prompt_ids(tokenizer, *prompt))
        assert last.usage.completion_tokens == len(ref)
        stopped = ref[-1] == 2 and len(ref) <= MAX_TOKENS
        if stopped:
            assert last.finish_reason == api.FINISH_REASON_STOP and stop_reason(last) == 2
        else:
            assert last.finish_reason == api.FINISH_REASON_LENGTH


def test_one_at_a_time_matches_hf(service, hf_greedy, tokenizer):
    check_against_hf(run_all(service, concurrently=False), hf_greedy, tokenizer)


def test_all_at_once_matches_hf(service, hf_greedy, tokenizer):
    check_against_hf(run_all(service, concurrently=True), hf_greedy, tokenizer)
    m = service.wait_idle()
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]


def test_long_prompt_is_chunked(service, tokenizer):
    long_len = len(prompt_ids(tokenizer, *PROMPTS[3]))
    assert long_len > BUDGET  # so it cannot be prefilled in one step
    m = service.metrics()
    # every step stayed within the token budget
    assert m[f'pagedserve_iteration_tokens_total_bucket{{le="{BUDGET}.0"}}'] == \
        m["pagedserve_iteration_tokens_total_count"]


def run_until_preempted(svc, mode, hf_greedy, tokenizer, rounds=3):
    """The 8 prompts at once, checked against HF each round, until a round has preempted
    (whether it does depends on how the concurrent requests happen to arrive); the metrics."""
    key = f'pagedserve_num_preemptions_total{{mode="{mode}"}}'
    for _ in range(rounds):
        check_against_hf(run_all(svc, concurrently=True), hf_greedy, tokenizer)
        m = svc.wait_idle()
        if m[key] > 0:
            return m
    raise AssertionError(f"no {mode} preemption in {rounds} rounds of 8 concurrent prompts")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(mode, tight_service, swap_service, hf_greedy,
                                            tokenizer):
    svc = tight_service if mode == "recompute" else swap_service
    m = run_until_preempted(svc, mode, hf_greedy, tokenizer)
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"] == 10
    assert m["pagedserve_num_requests_swapped"] == 0


def test_seeded_sampling_is_reproducible_alone_and_batched(service):
    kwargs = dict(chat=[("user", "Tell me a story about a cat.")], max_tokens=16,
                  temperature=0.9, top_p=0.95, top_k=50, seed=42, timeout=120)
    alone = service.client.complete(**kwargs)[1]
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda s: service.client.complete(
            **{**kwargs, "seed": s})[1], [41, 42, 43, 44]))
    assert batched[1] == alone
    assert len({tuple(b) for b in batched}) > 1


def test_stop_string_and_stop_token(service, hf_greedy, tokenizer):
    ref_text = tokenizer.decode(hf_greedy[4], skip_special_tokens=True)  # "The capital ... Paris."
    assert "Paris" in ref_text
    text, _, last = service.client.complete(chat=[("user", PROMPTS[4][1])], temperature=0,
                                            max_tokens=MAX_TOKENS, stop=["Paris"])
    assert text == ref_text[: ref_text.index("Paris")]
    assert last.finish_reason == api.FINISH_REASON_STOP and stop_reason(last) == "Paris"
    stop_id = hf_greedy[4][2]
    _, ids, last = service.client.complete(chat=[("user", PROMPTS[4][1])], temperature=0,
                                           max_tokens=MAX_TOKENS, stop_token_ids=[stop_id])
    assert ids == hf_greedy[4][:3] and stop_reason(last) == stop_id


def test_stream_interval_sends_fewer_messages_with_the_same_tokens(interval_service, hf_greedy,
                                                                   tokenizer):
    check_against_hf(run_all(interval_service, concurrently=True), hf_greedy, tokenizer)
    msgs = list(interval_service.client.generate(chat=[("user", PROMPTS[4][1])], temperature=0,
                                                 max_tokens=10, ignore_eos=True))
    sizes = [len(m.token_ids) for m in msgs]
    # the first token at once, then tokens 2-4, 5-8 and 9-10 (the finish flushes); messages a
    # slow reader left queued are merged, never split
    assert sizes[0] == 1 and sizes[1:] in ([3, 4, 2], [7, 2], [3, 6], [9])
    ids = [t for m in msgs for t in m.token_ids]
    assert "".join(m.text for m in msgs) == tokenizer.decode(ids, skip_special_tokens=True)
    assert msgs[-1].finish_reason == api.FINISH_REASON_LENGTH
    assert [m.finish_reason for m in msgs[:-1]] == [api.FINISH_REASON_UNSPECIFIED] * (
        len(msgs) - 1)


def test_ignore_eos_runs_to_max_tokens(service):
    _, ids, last = service.client.complete(chat=[("user", PROMPTS[4][1])], temperature=0,
                                           max_tokens=30, ignore_eos=True)
    assert len(ids) == 30 and last.finish_reason == api.FINISH_REASON_LENGTH


def test_prefix_cache_hits_keep_outputs_identical(service, hf_greedy, tokenizer):
    before = service.metrics()
    # every prompt ran before: all its full blocks but the one holding its last token are cached
    check_against_hf(run_all(service, concurrently=False), hf_greedy, tokenizer)
    after = service.metrics()
    expected = sum((len(prompt_ids(tokenizer, *p)) - 1) // 16 * 16 for p in PROMPTS)
    hits = "pagedserve_prefix_cache_hits_total"
    queries = "pagedserve_prefix_cache_queries_total"
    assert after[hits] - before[hits] == expected
    assert after[queries] - before[queries] == sum(
        len(prompt_ids(tokenizer, *p)) for p in PROMPTS)


def test_sync_scheduling_matches_hf(sync_service, hf_greedy, tokenizer):
    # all at once (one at a time is the main service's test: the step loop is the same)
    check_against_hf(run_all(sync_service, concurrently=True), hf_greedy, tokenizer)
    # a stop string ends the stream where it matches, max_tokens exactly
    text, _, last = sync_service.client.complete(chat=[("user", PROMPTS[4][1])], temperature=0,
                                                 max_tokens=MAX_TOKENS, stop=["Paris"])
    ref_text = tokenizer.decode(hf_greedy[4], skip_special_tokens=True)
    assert text == ref_text[: ref_text.index("Paris")] and stop_reason(last) == "Paris"
    _, ids, last = sync_service.client.complete(chat=[("user", PROMPTS[4][1])], temperature=0,
                                                max_tokens=30, ignore_eos=True)
    assert len(ids) == 30 and last.usage.completion_tokens == 30
    m = sync_service.wait_idle()
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]


def test_sync_scheduling_under_preemption_matches_hf(sync_tight_service, hf_greedy,
                                                     tokenizer):
    m = run_until_preempted(sync_tight_service, "recompute", hf_greedy, tokenizer)
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
