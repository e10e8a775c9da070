import numpy as np
import torch

from pagedserve.executor.sampler import Sampler, SamplingSpec, position_seed

CPU = torch.device("cpu")


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    assert Sampler(CPU)(x, [SamplingSpec()] * 4, [0] * 4) == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(rows=3)
    spec = SamplingSpec(temperature=1.0, seed=1234)
    alone = Sampler(CPU)(x[1:2], [spec], [17])
    batch = Sampler(CPU)(x, [SamplingSpec(temperature=0.7), spec, SamplingSpec(temperature=1.3)],
                         [5, 17, 9])
    assert batch[1] == alone[0]
    again = [Sampler(CPU)(x[1:2], [spec], [17])[0] for _ in range(3)]
    assert again == [alone[0]] * 3


def test_seeded_draws_vary_with_position():
    x = torch.zeros(1, 1000)  # uniform: any fixed token for all positions would be a bug
    spec = SamplingSpec(temperature=1.0, seed=7)
    draws = {Sampler(CPU)(x, [spec], [p])[0] for p in range(20)}
    assert len(draws) > 10


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits()
    s = Sampler(CPU, seed=0)
    greedy = x.argmax(-1).tolist()
    assert s(x, [SamplingSpec(temperature=1.0, top_k=1)] * 4, [0] * 4) == greedy
    assert s(x, [SamplingSpec(temperature=1.0, top_p=1e-6)] * 4, [0] * 4) == greedy


def test_top_k_and_top_p_restrict_the_support():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(CPU, seed=0)
    top_k = {s(x, [SamplingSpec(temperature=1.0, top_k=2)], [0])[0] for _ in range(200)}
    assert top_k == {0, 1}
    # top_p 0.8: {0.5, 0.3} reach 0.8 -> token 2 and 3 are cut
    top_p = {s(x, [SamplingSpec(temperature=1.0, top_p=0.8)], [0])[0] for _ in range(200)}
    assert top_p == {0, 1}


def test_sampling_follows_the_distribution():
    x = torch.log(torch.tensor([[0.25, 0.75]]))
    spec = [SamplingSpec(temperature=1.0, seed=99)]
    ones = sum(Sampler(CPU)(x, spec, [p])[0] for p in range(4000))
    assert 0.72 < ones / 4000 < 0.78


def test_seeds_a_power_of_two_apart_do_not_alias():
    x = torch.zeros(1, 1000)  # uniform: the draw is the generator's alone
    for a, b in ((5, 5 + 2**63), (0, 2**63), (7, 7 + 2**32)):
        draws = [[Sampler(CPU)(x, [SamplingSpec(temperature=1.0, seed=s)], [p])[0]
                  for p in range(8)] for s in (a, b)]
        assert draws[0] != draws[1], (a, b)
    assert len({position_seed(s, 3) for s in (1, 1 + 2**63, 2**64 - 1)}) == 3


# ---------------------------------------------------------------- penalties, filters, logprobs
# The oracle is HF transformers' logits processors (and, for what HF lacks, tests/hf_processors
# written from OpenAI's formula), applied to the same logits and token histories.

from pagedserve.executor.penalties import TokenCounts  # noqa: E402
from pagedserve.executor.sampler import SamplingBatch  # noqa: E402
from tests.hf_processors import processors  # noqa: E402

VOCAB = 64
EOS = 3


def hf_processors(spec, prompt_len):
    return processors(prompt_len, logit_bias=dict(spec.logit_bias), min_tokens=spec.min_tokens,
                      masked_ids=spec.min_tokens_masked_ids,
                      repetition_penalty=spec.repetition_penalty,
                      presence_penalty=spec.presence_penalty,
                      frequency_penalty=spec.frequency_penalty)


SPECS = [  # one row per feature, one with all, one plain
    SamplingSpec(repetition_penalty=1.3),
    SamplingSpec(repetition_penalty=0.7),
    SamplingSpec(presence_penalty=1.5),
    SamplingSpec(frequency_penalty=0.6),
    SamplingSpec(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingSpec(logit_bias=((5, 4.0), (9, -100.0), (EOS, 2.5))),
    SamplingSpec(min_tokens=6, min_tokens_masked_ids=(EOS, 7)),
    SamplingSpec(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                 logit_bias=((11, 3.0),), min_tokens=4, min_tokens_masked_ids=(EOS,)),
    SamplingSpec(),
]


class Rows:
    """The runner's part: per-row histories, count slots loaded on arrival."""

    def __init__(self, specs, prompts):
        self.specs, self.counts = specs, TokenCounts(VOCAB, CPU)
        self.history = [list(p) for p in prompts]
        self.prompt_lens = [len(p) for p in prompts]
        self.slots = [self.counts.acquire() if s.penalized else -1 for s in specs]
        self.counts.load([(slot, h, n) for slot, h, n in
                          zip(self.slots, self.history, self.prompt_lens, strict=True)
                          if slot >= 0])

    def batch(self):
        return SamplingBatch(list(self.specs), [len(h) for h in self.history],
                             num_output=[len(h) - n for h, n in
                                         zip(self.history, self.prompt_lens, strict=True)],
                             count_slots=list(self.slots), counts=self.counts)


def test_greedy_steps_with_each_penalty_and_filter_equal_hf_processors():
    """Twelve greedy steps on fresh random logits: each step's processed logits equal HF's
    processors on the row's history, so the counts kept on the device (loaded on arrival,
    then one scatter per step) track the history exactly."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 12, (len(SPECS),), generator=gen)]
    rows = Rows(SPECS, prompts)
    sampler = Sampler(CPU, seed=0)
    for _ in range(12):
        x = torch.randn(len(SPECS), VOCAB, generator=gen) * 3
        x[:, EOS] += 4  # EOS likely: min_tokens has something to hold back
        batch = rows.batch()
        ours = sampler.process(x, batch)
        for i, spec in enumerate(SPECS):
            want = hf_processors(spec, rows.prompt_lens[i])(
                torch.tensor([rows.history[i]]), x[i:i + 1].clone())
            torch.testing.assert_close(ours[i:i + 1], want, rtol=0, atol=1e-5)
        tokens = sampler.sample(x, batch).tokens.tolist()
        assert tokens == ours.argmax(-1).tolist()
        for h, t in zip(rows.history, tokens, strict=True):
            h.append(t)
    # the penalties changed what greedy picks (else this test could not fail)
    assert rows.history[0][rows.prompt_lens[0]:] != rows.history[-1][rows.prompt_lens[-1]:]
    # min_tokens held EOS back for 6 tokens
    assert EOS not in rows.history[6][rows.prompt_lens[6]:][:6]


def test_counts_rebuilt_from_token_ids_equal_incremental_ones():
    """Preemption by recompute reloads a request's counts from its token ids: the same counts
    as the incremental ones."""
    gen = torch.Generator().manual_seed(5)
    spec = SamplingSpec(frequency_penalty=0.4, repetition_penalty=1.1)
    rows = Rows([spec], [[1, 2, 2, 9]])
    sampler = Sampler(CPU)
    for _ in range(10):
        x = torch.randn(1, VOCAB, generator=gen)
        rows.history[0].append(sampler.sample(x, rows.batch()).tokens.item())
    again = TokenCounts(VOCAB, CPU)
    again.load([(again.acquire(), rows.history[0], 4)])
    slot = rows.slots[0]
    assert torch.equal(again.output[0], rows.counts.output[slot])
    assert torch.equal(again.prompt[0], rows.counts.prompt[slot])
    assert rows.counts.output[slot].sum().item() == 10


def test_a_plain_batch_skips_every_extra():
    x = logits()
    batch = SamplingBatch([SamplingSpec(temperature=0.8)] * 4, [0] * 4)
    assert Sampler(CPU).process(x, batch) is x
    assert Sampler(CPU).sample(x, batch).logprobs is None


def test_count_slots_grow_and_are_reused():
    counts = TokenCounts(VOCAB, CPU)
    slots = [counts.acquire() for _ in range(5)]
    assert sorted(slots) == [0, 1, 2, 3, 4] and counts.capacity == 8
    counts.load([(slots[2], [4, 4, 5], 1)])
    counts.release(slots[2])
    again = counts.acquire()
    assert again == slots[2]
    counts.load([(again, [6, 7], 2)])  # a new request in a reused slot starts from zero
    assert counts.output[again].sum().item() == 0
    assert counts.prompt[again].nonzero().flatten().tolist() == [6, 7]


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_top():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(CPU, seed=0)
    draws = {s(x, [SamplingSpec(temperature=1.0, min_p=0.2)], [0])[0] for _ in range(300)}
    assert draws == {0, 1, 2}  # 0.05 < 0.2 * 0.5


def test_seeded_penalized_rows_do_not_depend_on_the_batch():
    spec = SamplingSpec(temperature=1.0, seed=11, frequency_penalty=1.0)
    x = logits(rows=3, vocab=VOCAB)
    alone = Rows([spec], [[1, 2, 3]])
    together = Rows([SamplingSpec(temperature=0.5), spec, SamplingSpec(presence_penalty=1.0)],
                    [[4], [1, 2, 3], [5, 6]])
    a = Sampler(CPU).sample(x[1:2], alone.batch()).tokens.tolist()
    b = Sampler(CPU).sample(x, together.batch()).tokens.tolist()
    assert b[1] == a[0]


def test_logprobs_are_the_raw_log_softmax_and_its_top_k():
    """Of the logits before bias and penalties (vLLM's default), whatever token was chosen."""
    x = logits(rows=3, vocab=VOCAB)
    specs = [SamplingSpec(logprobs=5, logit_bias=((7, 100.0),)), SamplingSpec(),
             SamplingSpec(temperature=1.0, seed=1, logprobs=0)]
    out = Sampler(CPU).sample(x, SamplingBatch(specs, [0, 0, 0]))
    from pagedserve.executor.sampler import read_logprobs

    host = read_logprobs(out)
    ref = torch.log_softmax(x, -1)
    tokens = out.tokens.tolist()
    assert tokens[0] == 7  # the bias chose it; its logprob is still the raw one
    assert host.rows == [0, 2] and host.num_top == [5, 0]
    torch.testing.assert_close(torch.tensor(host.sampled),
                               torch.stack([ref[0, 7], ref[2, tokens[2]]]), rtol=0, atol=1e-6)
    top = ref[0].topk(5)
    assert host.top_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(host.top_logprobs), top.values, rtol=0, atol=1e-6)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V/32)] int32 bits (xgrammar's layout), by plain Python."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    out = []
    for r in range(rows):
        ws = []
        for w in range(words):
            v = sum(1 << b for b in range(32) if 32 * w + b < vocab and allowed[r, 32 * w + b])
            ws.append(v - (1 << 32) if v >= 1 << 31 else v)
        out.append(ws)
    return torch.tensor(out, dtype=torch.int32)


def test_bitmask_rows_sample_only_allowed_tokens_and_others_are_untouched():
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partial; bit 31 set in some words
    logits = torch.randn(4, vocab)
    allowed = torch.rand(2, vocab) < 0.2
    allowed[:, 31] = allowed[:, 63] = True
    specs = [SamplingSpec(), SamplingSpec(temperature=1.0, seed=5), SamplingSpec(),
             SamplingSpec(temperature=1.0, seed=6)]
    batch = SamplingBatch(specs, [3, 3, 3, 3], bitmask=_pack(allowed), bitmask_rows=[0, 3])
    x = Sampler(torch.device("cpu")).process(logits, batch)
    assert torch.equal(x[[1, 2]], logits[[1, 2]])
    expect = torch.where(allowed, logits[[0, 3]], torch.full_like(logits[[0, 3]], -torch.inf))
    assert torch.equal(x[[0, 3]], expect)
    sampler = Sampler(torch.device("cpu"), seed=0)
    for _ in range(50):
        out = sampler.sample(logits, batch).tokens
        assert allowed[0, out[0]] and allowed[1, out[3]]
    assert out[2] == logits[2].argmax()


def test_a_bitmask_narrower_than_the_logits_allows_none_past_it():
    """Rows as wide as the tokenizer's ids (2 words, 64 ids) over 100 logits: ids 64-99, the
    largest logits here, are never sampled."""
    logits = torch.arange(100, dtype=torch.float32)[None].repeat(2, 1)
    allowed = torch.ones(2, 64, dtype=torch.bool)
    allowed[1, 63] = False
    batch = SamplingBatch([SamplingSpec(), SamplingSpec()], [1, 1], bitmask=_pack(allowed),
                          bitmask_rows=[0, 1])
    x = Sampler(torch.device("cpu")).process(logits, batch)
    assert torch.isinf(x[:, 64:]).all() and torch.equal(x[0, :64], logits[0, :64])
    assert Sampler(torch.device("cpu")).sample(logits, batch).tokens.tolist() == [63, 62]


def test_bitmask_leaves_logprobs_those_of_the_raw_logits():
    logits = torch.randn(1, 40)
    allowed = torch.zeros(1, 40, dtype=torch.bool)
    allowed[0, 7] = True
    batch = SamplingBatch([SamplingSpec(logprobs=0)], [1], bitmask=_pack(allowed),
                          bitmask_rows=[0])
    out = Sampler(torch.device("cpu")).sample(logits, batch)
    assert out.tokens.tolist() == [7]
    assert torch.allclose(out.logprobs[0, 0], torch.log_softmax(logits, -1)[0, 7])


def test_the_whole_batch_draws_in_one_launch(monkeypatch):
    """Seeded and unseeded rows share one exponential race over the batch (a launch per seeded
    row was per-request work each step), each row keyed as Sampler.keys says."""
    calls = []
    sampler = Sampler(CPU, seed=0)
    real = sampler._race

    def counting(probs, keys):
        calls.append((tuple(probs.shape), keys.tolist()))
        return real(probs, keys)

    monkeypatch.setattr(sampler, "_race", counting)
    x = logits(rows=6)
    specs = [SamplingSpec(temperature=1.0)] * 4 + [SamplingSpec(temperature=1.0, seed=3)] * 2
    sampler(x, specs, list(range(6)))
    assert [shape for shape, _ in calls] == [(6, 50)]
    seeded = [k % 2**64 for k in calls[0][1][4:]]
    assert seeded == [position_seed(3, 4), position_seed(3, 5)]


def test_batch_keys_equal_position_seed():
    """Sampler.keys (numpy, over the batch) equals position_seed for every seed, negative and
    past 2**63 included; unseeded rows get keys of their own."""
    seeds = [0, 1, 7, -1, 2**63, 2**64 - 1, 123456789]
    specs = [SamplingSpec(temperature=1.0, seed=s) for s in seeds] + [SamplingSpec(1.0)] * 2
    keys = Sampler(CPU, seed=0).keys(specs, list(range(len(specs))))
    assert [int(k) % 2**64 for k in keys[:len(seeds)]] == [
        position_seed(s, p) for p, s in enumerate(seeds)]
    assert keys.dtype == np.int64 and keys[-1] != keys[-2]
