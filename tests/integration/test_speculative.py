"""Speculative decoding in the whole service. N-gram prompt lookup: greedy outputs equal HF's
token for token, one at a time and all at once, through chunked prefill, the prefix cache and
swap preemption; seeded samples, stop strings inside an accepted run and n > 1 equal the service
without speculation; the drafts are counted, and some are accepted and some rejected. A draft
model (the default model as its own draft): every draft is accepted, through recompute
preemption and an executor killed with -9 mid-stream. An EAGLE-3 head (random, in the public
layout): HF's tokens through swap preemption, its drafts proposed and verified."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2 as api
from tests.integration.conftest import BUDGET, PROMPTS, TIGHT, _serving
from tests.integration.test_generation import check_against_hf, run_all

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_service(tmp_path_factory, model_dir):
    """The tight KV pool (8 prompts at once must preempt), swapping, a budget that chunks the
    long prompt, and n-gram drafts of up to 3 tokens from 1-grams up (so most steps draft)."""
    yield from _serving(tmp_path_factory, "spec", *TIGHT[2:], "--max-num-batched-tokens",
                        str(BUDGET), "--preemption-mode", "swap", "--swap-space-gib", "0.25",
                        "--speculative-config", json.dumps(NGRAM))


@pytest.fixture(scope="module")
def draft_service(tmp_path_factory, model_dir):
    """The default model as its own draft, 3 drafts a step, in the tight KV pool with
    recompute preemption."""
    yield from _serving(tmp_path_factory, "draft", *TIGHT[2:], "--max-num-batched-tokens",
                        str(BUDGET), "--preemption-mode", "recompute",
                        "--speculative-config", json.dumps(DRAFT))


DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def eagle_config(tmp_path_factory, model_dir):
    """A random EAGLE-3 head for the default model (a 4,096-token draft vocabulary)."""
    from transformers import AutoConfig

    from tests.executor_svc.test_eagle import head_tensors, write_head

    cfg = AutoConfig.from_pretrained(model_dir)
    head = write_head(tmp_path_factory.mktemp("eagle3"), 3,
                      head_tensors(3, seed=1, cfg=cfg, draft_vocab=4096), cfg, 4096)
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def eagle_service(tmp_path_factory, eagle_config):
    """The head in the tight KV pool, swapping (its cache is copied with the target's)."""
    yield from _serving(tmp_path_factory, "eagle", *TIGHT[2:], "--max-num-batched-tokens",
                        str(BUDGET), "--preemption-mode", "swap", "--swap-space-gib", "0.25",
                        "--speculative-config", json.dumps(eagle_config))


def spec_counts(m: dict[str, float]) -> tuple[float, float]:
    return (m["pagedserve_spec_decode_num_draft_tokens_total"],
            m["pagedserve_spec_decode_num_accepted_tokens_total"])


def test_greedy_one_at_a_time_matches_hf(spec_service, hf_greedy, tokenizer):
    before = spec_service.metrics()
    check_against_hf(run_all(spec_service, concurrently=False), hf_greedy, tokenizer)
    m = spec_service.wait_idle()
    drafts = m["pagedserve_spec_decode_num_draft_tokens_total"] - \
        before["pagedserve_spec_decode_num_draft_tokens_total"]
    accepted = m["pagedserve_spec_decode_num_accepted_tokens_total"] - \
        before["pagedserve_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < drafts  # both ways through verification
    assert m['pagedserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] >= \
        m['pagedserve_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] > 0


def until_preempted(svc, mode: str, hf_greedy, tokenizer) -> list[tuple[float, float]]:
    """Every prompt at once, HF's greedy tokens each round, until the tight pool has
    preempted (in `mode`) at least once, 3 rounds at most; then every block is free again.
    Each round's drafted and accepted tokens."""
    key = f'pagedserve_num_preemptions_total{{mode="{mode}"}}'
    rounds = []
    for _ in range(3):
        before = spec_counts(svc.metrics())
        check_against_hf(run_all(svc, concurrently=True), hf_greedy, tokenizer)
        m = svc.wait_idle()
        rounds.append(tuple(a - b for a, b in zip(spec_counts(m), before, strict=True)))
        if m[key] > 0:
            break
    assert m[key] > 0
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"] == 10
    return rounds


def test_greedy_all_at_once_matches_hf_through_swap_preemption(spec_service, hf_greedy,
                                                               tokenizer):
    until_preempted(spec_service, "swap", hf_greedy, tokenizer)


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(draft_service, hf_greedy,
                                                                    tokenizer):
    """All at once, recomputing the preempted (the draft's KV with them); a verification that
    rejected a correct draft would leave accepted below drafted."""
    for drafted, accepted in until_preempted(draft_service, "recompute", hf_greedy, tokenizer):
        assert accepted == drafted > 100
    info = draft_service.client.stub.GetModelInfo(api.GetModelInfoRequest(), timeout=10)
    assert json.loads(info.speculative_config) == DRAFT
    with urllib.request.urlopen(draft_service.http_url + "/v1/models", timeout=10) as r:
        assert json.load(r)["data"][0]["speculative_config"] == DRAFT


def test_an_eagle3_head_keeps_hf_tokens_through_swap_preemption(eagle_service, eagle_config,
                                                                hf_greedy, tokenizer):
    for drafted, accepted in until_preempted(eagle_service, "swap", hf_greedy, tokenizer):
        assert drafted > 100 and 0 <= accepted <= drafted
    info = eagle_service.client.stub.GetModelInfo(api.GetModelInfoRequest(), timeout=10)
    assert json.loads(info.speculative_config) == eagle_config


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["spec_service", "draft_service", "eagle_service"])
def test_a_speculating_stream_survives_its_executor_killed(name, request, hf_greedy):
    """Each method: the drafts in flight are lost with the executor, the stream is recomputed
    on the one serve restarts, and it ends with HF's tokens."""
    from tests.integration.test_faults import processes

    svc = request.getfixturevalue(name)
    stream = svc.client.stub.Generate(
        build_request(chat=[("user", PROMPTS[4][1])], temperature=0, max_tokens=24), timeout=150)
    ids = list(next(stream).token_ids)
    processes(svc)["executor"].kill()
    for chunk in stream:
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    svc.wait_serving()


STORY = dict(chat=[("user", "Repeat exactly: the cat sat on the mat, the cat sat on the mat, "
                            "the cat sat on the mat.")], max_tokens=20)


def test_seeded_samples_equal_those_without_speculation(spec_service, service):
    """A sample at a position is drawn with that position's seed from the target's
    distribution either way, so the tokens are the same ones."""
    kwargs = dict(**STORY, temperature=0.8, top_p=0.95, top_k=50, min_p=0.02, seed=11,
                  timeout=120)
    want = service.client.complete(**kwargs)[1]
    assert spec_service.client.complete(**kwargs)[1] == want
    with ThreadPoolExecutor(4) as pool:  # batched with others, the same
        got = list(pool.map(lambda s: spec_service.client.complete(**{**kwargs, "seed": s})[1],
                            [11, 12, 13, 14]))
    assert got[0] == want


def test_stop_strings_and_n_end_where_they_do_without_speculation(spec_service, service,
                                                                  tokenizer):
    ids = service.client.complete(**STORY, temperature=0, timeout=120)[1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 4]  # inside the run the drafts predict
    for svc in (service, spec_service):
        out, _, last = svc.client.complete(**STORY, temperature=0, stop=[stop], timeout=120)
        assert out == text[:text.index(stop)]
        assert last.finish_reason == api.FINISH_REASON_STOP
    req = dict(**STORY, temperature=0.7, seed=5, n=3, timeout=120)
    assert by_index(spec_service, req) == by_index(service, req)


def by_index(svc, req: dict) -> dict[int, list[int]]:
    """An n > 1 request's token ids, by completion."""
    out: dict[int, list[int]] = {}
    for r in svc.client.generate(**req):
        out.setdefault(r.index, []).extend(r.token_ids)
    return out


def test_max_tokens_inside_an_accepted_run_ends_at_its_token(spec_service, service):
    for n in (1, 2, 5, 7):
        req = {**STORY, "max_tokens": n}
        want = service.client.complete(**req, temperature=0, timeout=120)
        got = spec_service.client.complete(**req, temperature=0, timeout=120)
        assert got[1] == want[1] and len(got[1]) == n
        assert got[2].finish_reason == api.FINISH_REASON_LENGTH


@pytest.mark.parametrize("config, error", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa'"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1, got None"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min 4 is more than prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 64}, "does not fit --max-num-batched-tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown key 'lookup'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
])
def test_a_bad_speculative_config_is_one_line_and_a_nonzero_exit(config, error):
    import subprocess
    import sys

    for command in ("serve", "executor"):  # (the executor reads it too: draft_model)
        run = subprocess.run([sys.executable, "-m", "pagedserve.cli", command,
                              "--max-num-batched-tokens", "64",
                              "--speculative-config", json.dumps(config)],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode != 0
        assert run.stderr.strip().splitlines()[-1].startswith(f"pagedserve {command}: "
                                                              "--speculative-config: ")
        assert error in run.stderr


def test_a_request_with_min_tokens_is_not_drafted_and_ends_as_without(spec_service, service):
    """The executor masks by a request's output count, one per step: such a request decodes
    undrafted (a draft past min_tokens used to fail its whole step)."""
    req = {**STORY, "min_tokens": 2, "temperature": 0, "timeout": 120}
    before = spec_service.metrics()["pagedserve_spec_decode_num_drafts_total"]
    got, want = spec_service.client.complete(**req), service.client.complete(**req)
    assert (got[1], got[2].finish_reason) == (want[1], want[2].finish_reason)
    assert spec_service.wait_idle()["pagedserve_spec_decode_num_drafts_total"] == before
