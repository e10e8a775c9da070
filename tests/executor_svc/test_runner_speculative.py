"""Verification of speculative drafts in the runner: greedy and seeded rows keep the very tokens
they get without drafts, and sampled rows follow the target's distribution whatever the drafts
(chi-square on an 8-token vocabulary against HF's probabilities), for temperature, top-p and
min-p; a step's rejected positions are rolled back on the executor's side."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.protos.internal.v1 import executor_pb2 as pb

VOCAB = 8
PROMPT = [1, 2, 3]
# chi-square at p = 0.001 by degrees of freedom (1..7): a correct sampler fails 1 in 1000 runs,
# and the seeds are fixed, so a run that passes always passes
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-layer Llama over 8 tokens whose next-token distributions are spread (after
    [1, 2, 3]: 0.42 0.08 0.14 0.05 0.06 0.07 0.08 0.11 at temperature 1)."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(3)
    cfg = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                               max_position_embeddings=64, initializer_range=0.1,
                               tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(path)
    return path, hf


def runner(path, blocks):
    return Worker(ExecutorConfig(model=str(path), device="cpu", num_kv_blocks=blocks,
                                 block_size=16)).runner


def sampling(temperature, seed, top_p=1.0, min_p=0.0):
    s = pb.Sampling(temperature=temperature, top_p=top_p, min_p=min_p)
    if seed is not None:
        s.has_seed, s.seed = True, seed
    return s


def draft_step(run, n, drafts, **params):
    """n requests of PROMPT: its first two tokens prefilled, then a step at its last token
    with these drafts; each request's kept tokens."""
    plan = pb.StepPlan(step_id=1)
    for i in range(n):
        plan.new_requests.add(req_id=i + 1, token_ids=PROMPT, block_ids=[i],
                              sampling=sampling(seed=i, **params))
        plan.new_num_scheduled_tokens.append(len(PROMPT) - 1)
    assert run.execute(plan) == ([], [])
    ids = list(range(1, n + 1))
    step = pb.StepPlan(step_id=2, cached_req_ids=ids, cached_num_computed_tokens=[2] * n,
                       cached_num_scheduled_tokens=[1 + len(drafts)] * n,
                       cached_num_new_blocks=[0] * n,
                       cached_num_spec_tokens=[len(drafts)] * n,
                       cached_spec_token_ids=list(drafts) * n)
    got: dict[int, list[int]] = {}
    for rid, tok in zip(*run.execute(step), strict=True):
        got.setdefault(rid, []).append(tok)
    assert sorted(got) == ids and all(1 <= len(t) <= len(drafts) + 1 for t in got.values())
    assert (run.cols.num_computed[run.cols.req_id > 0] == [2 + len(got[r]) for r in ids]).all()
    return [got[r] for r in ids]


def target(hf, context, temperature, top_p=1.0, min_p=0.0):
    """The target's distribution after context: softmax(logits / T), then top-p and min-p as
    vLLM and HF define them (keep the fewest most likely tokens reaching top_p; drop those
    below min_p x the most likely), renormalised."""
    with torch.no_grad():
        logits = hf(torch.tensor([context])).logits[0, -1].double()
    p = torch.softmax(logits / temperature, -1)
    order = p.argsort(descending=True)
    before = torch.cumsum(p[order], 0) - p[order]
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[order[before < top_p]] = True
    keep &= p >= min_p * p.max()
    p = torch.where(keep, p, 0)
    return (p / p.sum()).tolist()


def assert_follows(samples, probs):
    counts = [samples.count(t) for t in range(VOCAB)]
    n = len(samples)
    assert all(c == 0 for c, q in zip(counts, probs, strict=True) if q == 0), (counts, probs)
    cells = [(c, n * q) for c, q in zip(counts, probs, strict=True) if q > 0]
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    assert chi2 < CHI2_999[len(cells) - 2], (chi2, counts, [round(e) for _, e in cells])


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                    dict(temperature=1.3, min_p=0.1)],
                         ids=["temperature", "top_p", "min_p"])
def test_sampled_tokens_follow_the_target_whatever_the_drafts(tiny, params):
    path, hf = tiny
    n = 12_000  # a 2 % shift between the two likeliest tokens fails 99 runs in 100
    first = target(hf, PROMPT, **params)
    likely = max(range(VOCAB), key=first.__getitem__)
    wrong = min(range(VOCAB), key=first.__getitem__)  # (outside top-p and min-p: never kept)
    run = runner(path, n)
    for drafts in ([likely, likely], [wrong, likely]):
        out = draft_step(run, n, drafts, **params)
        assert_follows([t[0] for t in out], first)
        if drafts[0] == likely:  # the second position, given the first draft was kept
            second = target(hf, PROMPT + [likely], **params)
            assert_follows([t[1] for t in out if t[0] == likely], second)
        run.reset()


def test_greedy_and_seeded_rows_keep_the_tokens_they_get_without_drafts(tiny):
    path, _ = tiny
    for temperature in (0.0, 1.0):
        plain = runner(path, 64)
        want = [t[0] for t in draft_step(plain, 64, [], temperature=temperature)]
        drafted = runner(path, 64)
        got = draft_step(drafted, 64, [want[0], 5, 5], temperature=temperature)
        assert [t[0] for t in got] == want
        kept = sum(len(t) - 1 for t in got)
        assert kept > 0  # some rows' first draft is theirs


class EagerDecodeGraphs(DecodeGraphs):
    """DecodeGraphs on the CPU, each 'graph' replaying eagerly what capture() would record
    (the model over the static buffers, one query token per row): the runner's flattening of
    verification steps into decode rows and the draft's chained proposal passes are checked
    here, the captured graphs on the GPU (test_cuda_graphs). batches: each replay's rows."""

    def __init__(self, model, kv_caches, max_batch=64):
        super().__init__(model, kv_caches, max_batch, 64, 16, torch.device("cpu"))
        self.batches = []
        for bs in self.sizes:
            self.graphs[bs] = SimpleNamespace(replay=lambda bs=bs: self.model(*self._args(bs)))

    def run(self, input_ids, *rest, **kw):
        self.batches.append(len(input_ids))
        return super().run(input_ids, *rest, **kw)

    def greedy_chain(self, tokens, positions, *rest):
        self.batches += [len(tokens)] * len(positions)
        return super().greedy_chain(tokens, positions, *rest)


def test_verification_steps_replay_the_decode_graphs_one_row_per_token(tiny):
    path, _ = tiny
    for temperature in (0.0, 1.0):
        eager = draft_step(runner(path, 16), 16, [3, 0, 3], temperature=temperature)
        run = runner(path, 16)
        run.graphs = graphs = EagerDecodeGraphs(run.model, run.kv_caches)
        assert draft_step(run, 16, [3, 0, 3], temperature=temperature) == eager
        assert graphs.batches == [16 * 4] and run.last_step_graphed


def spec_plan(step_id, computed, drafts, ids=None):
    return pb.StepPlan(step_id=step_id, cached_req_ids=[1], cached_num_computed_tokens=[computed],
                       cached_num_scheduled_tokens=[1 + len(drafts)], cached_num_new_blocks=[0],
                       cached_num_spec_tokens=[len(drafts)],
                       cached_spec_token_ids=drafts if ids is None else ids)


def test_drafts_that_do_not_add_up_or_come_before_the_last_are_verified_fail(tiny):
    path, _ = tiny
    run = runner(path, 4)
    kept = len(draft_step(run, 1, [4, 4], temperature=0.0)[0])
    with pytest.raises(ValueError, match="cached_num_spec_tokens and cached_spec_token_ids do "
                                         "not add up"):
        run.execute(spec_plan(3, 2 + kept, [4, 4], ids=[4]))
    launched = run.launch(spec_plan(3, 2 + kept, [4, 4]))  # its tokens not read yet
    with pytest.raises(ValueError, match="request 1: planned before its drafts were verified"):
        run.launch(spec_plan(4, 2 + kept + 3, []))
    assert run.finish(launched)[0][0] == 1


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(tiny, graphed):
    """The draft-model path with the target as its own draft: its greedy proposals are the
    target's greedy tokens, so verification keeps every one (a rejected correct draft fails
    here), and the tokens equal HF's greedy ones. Graphed: the target's verification steps,
    the draft's mirror of them and its proposal passes go through (eager stand-ins of) the
    decode graphs."""
    path, hf = tiny
    run = Worker(ExecutorConfig(model=str(path), device="cpu", num_kv_blocks=4, block_size=16,
                                draft_model=str(path))).runner
    if graphed:
        run.graphs = EagerDecodeGraphs(run.model, run.kv_caches)
        run.draft.graphs = EagerDecodeGraphs(run.draft.model, run.draft.kv_caches)
    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                       pad_token_id=0)[0, len(PROMPT):].tolist()
    plan = pb.StepPlan(step_id=1, num_lookahead_tokens=3)
    plan.new_requests.add(req_id=7, token_ids=PROMPT, block_ids=[0, 1],
                          sampling=sampling(0.0, None))
    plan.new_num_scheduled_tokens.append(len(PROMPT))
    launched = run.launch(plan)
    got = run.finish(launched)[1]
    steps, drafted, kept = 1, 0, 0
    while len(got) < 20:
        rids, n, drafts = launched.proposals
        assert rids == [7] and n == [len(drafts)] and 1 <= len(drafts) <= 3
        computed = len(PROMPT) + len(got) - 1
        steps += 1
        launched = run.launch(pb.StepPlan(
            step_id=steps, cached_req_ids=[7], cached_num_computed_tokens=[computed],
            cached_num_scheduled_tokens=[1 + len(drafts)], cached_num_new_blocks=[0],
            cached_num_spec_tokens=[len(drafts)], cached_spec_token_ids=drafts,
            num_lookahead_tokens=3))
        out = run.finish(launched)[1]
        drafted, kept = drafted + len(drafts), kept + len(out) - 1
        got += out
    assert got[:20] == want
    assert kept == drafted > 0 and steps <= 1 + -(-19 // 4)
    assert run.draft.proposed_tokens >= drafted
    if graphed:  # verification steps of 1 + k rows; the mirror of each, then passes of 1 row
        assert run.graphs.batches and all(b > 1 for b in run.graphs.batches)
        assert sorted(set(run.draft.graphs.batches)) == sorted({1} | set(run.graphs.batches))


def test_a_draft_with_another_vocabulary_is_refused(tiny, tmp_path):
    from pagedserve.executor.draft import DraftModelError

    path, _ = tiny
    cfg = AutoConfig.for_model("llama", vocab_size=VOCAB + 1, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(DraftModelError, match="vocabulary of 9 tokens, the target 8"):
        Worker(ExecutorConfig(model=str(path), device="cpu", num_kv_blocks=4,
                              draft_model=str(tmp_path)))
