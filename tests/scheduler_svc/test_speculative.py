"""The scheduler's half of speculative decoding: --speculative-config, the n-gram lookup, and
drafts planned in the token budget and blocks, rolled back by what the executor rejected."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.core.speculative import SpeculativeConfig, SpeculativeConfigError
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.request import GenerationParams, Request
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedserve.scheduler.speculative import NgramProposer, propose


def test_the_longest_latest_match_gives_the_drafts():
    toks = np.array([1, 2, 3, 9, 9, 5, 2, 3, 8, 4, 1, 2, 3])
    # suffix [1, 2, 3]: at 0 (3 long); [2, 3] also at 6, shorter: the longest wins
    assert propose(toks, 3, 2, 3) == [9, 9, 5]
    assert propose(toks, 3, 2, 2) == [8, 4, 1]  # with 2-grams only, the latest
    assert propose(toks, 3, 4, 5) == []  # [9, 1, 2, 3] never came before
    assert propose(np.array([7, 7, 7, 7]), 5, 1, 3) == [7]  # up to the end: fewer than k
    assert propose(np.array([4, 5]), 2, 2, 2) == []


def test_the_proposer_keeps_each_requests_tokens_and_appends_to_them():
    p = NgramProposer(1, 2)
    tokens = [3, 4, 5, 3]
    assert p.propose(7, tokens, 2) == [4, 5]
    tokens += [4, 6, 3, 4]
    assert p.propose(7, tokens, 3) == [6, 3, 4]  # [3, 4] latest at 3
    assert list(p.tokens(7, tokens)) == tokens
    assert p.propose(7, tokens[:2], 1) == []  # cut shorter (recomputed): rebuilt
    p.forget(7)
    assert p._arrays == {}


def test_config_keys_defaults_and_ranges():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                '"num_speculative_tokens_per_batch_size": [[1, 4, 4], '
                                '[5, 16, 2], [17, 100000, 0]]}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
    assert [c.tokens_for(n) for n in (1, 4, 5, 16, 17, 200000)] == [4, 4, 2, 2, 0, 4]
    assert SpeculativeConfig.parse("") is None
    only_max = SpeculativeConfig.parse('{"num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert (only_max.method, only_max.prompt_lookup_min, only_max.prompt_lookup_max) == \
        ("ngram", 3, 3)
    for text, why in [("[1]", "a JSON object is needed"), ("{", "not JSON"),
                      ('{"method": "eagle3", "num_speculative_tokens": 2}',
                       "method 'eagle3' needs \"model\": the EAGLE head's directory"),
                      ('{"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size":'
                       ' [[4, 2, 1]]}',
                       r"num_speculative_tokens_per_batch_size: \[4, 2, 1\] is not"),
                      ('{"num_speculative_tokens": true}',
                       "num_speculative_tokens must be an integer >= 1, got True"),
                      ('{"method": "draft_model", "num_speculative_tokens": 2}',
                       "method 'draft_model' needs \"model\""),
                      ('{"method": "ngram", "model": "x", "num_speculative_tokens": 2}',
                       "method 'ngram' takes no \"model\""),
                      ('{"model": "x", "num_speculative_tokens": 2, '
                       '"draft_tensor_parallel_size": 2}',
                       "draft_tensor_parallel_size 2: only 1 is built")]:
        with pytest.raises(SpeculativeConfigError, match="^--speculative-config: " + why):
            SpeculativeConfig.parse(text)
    draft = SpeculativeConfig.parse('{"model": "default", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.drafts_in_executor) == ("draft_model", "default",
                                                                     True)
    assert not c.drafts_in_executor
    eagle = SpeculativeConfig.parse('{"method": "eagle", "model": "h", '
                                    '"num_speculative_tokens": 3}')
    assert (eagle.method, eagle.model, eagle.drafts_in_executor) == ("eagle", "h", True)
    with pytest.raises(SpeculativeConfigError, match="does not fit max_model_len 4"):
        c.check(4, 100)


def make(k=3, budget=16, blocks=8, per_batch=(), caching=True, method="ngram"):
    spec = SpeculativeConfig(method, k, 1, 3, per_batch,
                             model="draft" if method == "draft_model" else "")
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                          enable_prefix_caching=caching, speculative=spec)
    return Scheduler(cfg, BlockManager(blocks, 4, 0, caching))


def running(s, rid, tokens, first=9, **params):
    """A request whose prompt (tokens) is computed, in chunks if the budget says so, and whose
    first output token came back."""
    r = Request(rid, f"r{rid}", len(tokens), list(tokens),
                GenerationParams(max_tokens=params.pop("max_tokens", 50), **params),
                arrival_seq=rid)
    s.add(r)
    while r.num_computed_tokens < len(tokens):
        assert not s.schedule().cached[0:0]
    s.update([rid], [first])
    return r


def test_drafts_take_budget_and_blocks_and_rejections_roll_back():
    s = make()
    r = running(s, 1, [5, 6, 7, 9, 5, 6])  # then 9: "6 9"' is new, "9" came after 7
    assert r.token_ids == [5, 6, 7, 9, 5, 6, 9]
    out = s.schedule()
    (c,) = out.cached
    assert (c.start, c.num_tokens, c.spec_token_ids) == (6, 4, [5, 6, 9])
    assert out.num_batched_tokens == 4
    assert s.blocks.block_table(1) == [0, 1, 2]  # positions 0..9
    assert r.num_computed_tokens == 10
    got = s.update([1, 1], [5, 8])  # first draft kept, the second replaced by 8
    assert [x.token for x in got] == [5, 8]
    assert r.token_ids[-3:] == [9, 5, 8] and r.num_computed_tokens == 8
    assert (s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens) == (1, 3, 1)
    assert s.spec_accepted_per_pos == [1, 0, 0]
    # prefix-cache hashes cover known tokens only: the first block when the drafts went out,
    # the second (positions 4-7, the kept draft in it) at the next plan
    assert len(s.blocks._hashes[1]) == 1
    out = s.schedule()
    assert out.cached[0].start == 8 and len(s.blocks._hashes[1]) == 2


def test_no_drafts_where_speculation_does_not_reach():
    s = make(budget=3)
    r = running(s, 1, [5, 6, 5, 6, 5], first=6)
    assert s.schedule().cached[0].spec_token_ids == [5, 6]  # the budget's 3 tokens
    s.update([1, 1, 1], [5, 6, 5])
    for params in (dict(presence_penalty=0.5), dict(repetition_penalty=1.2),
                   dict(min_tokens=10), dict(min_tokens=1), dict(max_tokens=3)):
        s2 = make()
        running(s2, 2, [5, 6, 5, 6, 5], first=6, **params)
        out = s2.schedule()  # max_tokens 3: the step's own token and one draft
        assert out.cached[0].spec_token_ids == ([] if "max_tokens" not in params else [5])
    s3 = make(per_batch=((1, 1, 0),))
    running(s3, 3, [5, 6, 5, 6, 5], first=6)
    assert s3.num_drafts() == 0 and s3.schedule().cached[0].spec_token_ids == []
    assert s.schedule(ahead=True).cached[0].spec_token_ids == []  # planned ahead: none
    assert r.num_computed_tokens == 9


def test_a_draft_that_finds_no_block_is_dropped_not_preempting():
    s = make(blocks=2)  # 8 slots: the 7-token request fits, its 3 drafts would not
    r = running(s, 1, [5, 6, 5, 6, 5, 6], first=5)
    out = s.schedule()
    assert out.cached[0].spec_token_ids == [] and out.cached[0].num_tokens == 1
    assert s.num_preemptions == 0 and r.num_computed_tokens == 7


def test_a_result_with_more_tokens_than_drafts_is_refused():
    s = make()
    running(s, 1, [5, 6, 5, 6, 5], first=6)
    assert s.schedule().cached[0].spec_token_ids == [5, 6]  # the array's end: fewer than k
    with pytest.raises(ValueError, match="request 1: 4 tokens for 2 drafts"):
        s.update([1] * 4, [1] * 4)


def test_a_draft_models_proposals_are_planned_once_after_the_token_they_follow():
    s = make(method="draft_model", blocks=4)
    r = running(s, 1, [5, 6, 7, 8, 9])  # 6 tokens known, 5 computed
    assert s.proposer is None
    out = s.schedule()  # no proposals yet: one token, and blocks for 3 drafts after it
    (c,) = out.cached
    assert (c.num_tokens, c.spec_token_ids, out.num_lookahead_tokens) == (1, [], 3)
    assert s.blocks.block_table(1) == [0, 1, 2]  # positions 0..8: the token, 3 lookahead
    s.update([1], [4], proposals={1: [3, 2, 1]})
    assert (r.proposed, r.proposed_at) == ([3, 2, 1], 7)
    out = s.schedule()
    (c,) = out.cached
    assert (c.start, c.num_tokens, c.spec_token_ids) == (6, 4, [3, 2, 1])
    assert s.blocks.block_table(1) == [0, 1, 2, 3]  # 3 drafts and 3 lookahead: up to 12
    s.update([1, 1], [3, 7], proposals={1: [8]})  # one kept
    assert r.num_computed_tokens == 8 and r.token_ids[-2:] == [3, 7]
    assert s.schedule().cached[0].spec_token_ids == [8]
    s.update([1], [6])  # rejected; no proposals came: none planned
    assert s.schedule().cached[0].spec_token_ids == []
    assert (s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens) == (2, 4, 1)
    # lookahead stops at the last position the request can reach: prompt + max_tokens
    s2 = make(method="draft_model", blocks=4)
    running(s2, 2, [5, 6, 7, 8, 9], max_tokens=2)  # 6 known, the last reachable 7th
    assert s2.schedule().num_lookahead_tokens == 3
    assert s2.blocks.block_table(2) == [0, 1]  # 7 slots, not 6 + 3
