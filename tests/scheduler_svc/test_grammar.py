"""The scheduler's side of structured outputs: the grammar cache and compile thread, matchers
advancing with the tokens, the end when a match is whole, and the batched fill."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import xgrammar as xgr

from pagedserve.scheduler.grammar import Grammars
from pagedserve.scheduler.invalid import InvalidRequest
from pagedserve.scheduler.request import Constraint, GenerationParams, Request
from tests.scheduler_svc.test_scheduler import make

VOCAB = ["a", "b", "c", "</s>"]  # a toy vocabulary: token 3 is EOS
EOS = 3


def matcher(regex: str) -> xgr.GrammarMatcher:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))


def constrained(rid: int, regex: str, max_tokens: int = 10) -> Request:
    r = Request(rid, f"r{rid}", 2, [0, 1], GenerationParams(max_tokens=max_tokens),
                arrival_seq=rid)
    r.matcher = matcher(regex)
    return r


def test_the_request_ends_when_its_match_is_whole_and_eos_comes():
    s = make()
    s.eos_token_ids = frozenset([EOS])
    r = constrained(1, "ab")
    s.add(r)
    s.schedule()
    assert s.update([1], [0])[0].finish_reason is None  # "a"
    s.schedule()
    assert s.update([1], [1])[0].finish_reason is None  # "ab": whole, EOS still to come
    s.schedule()
    done = s.update([1], [EOS])[0]
    assert (done.finish_reason, done.stop_reason) == ("stop", EOS)
    assert r.matcher.is_terminated()


def test_ignore_eos_still_ends_at_the_grammars_end():
    s = make()
    s.eos_token_ids = frozenset([EOS])
    r = Request(1, "r1", 2, [0, 1], GenerationParams(max_tokens=10, ignore_eos=True))
    r.matcher = matcher("a")
    s.add(r)
    s.schedule()
    s.update([1], [0])
    s.schedule()
    done = s.update([1], [EOS])[0]
    assert (done.finish_reason, done.stop_reason) == ("stop", None)


def test_a_token_the_grammar_refuses_ends_the_request():
    s = make()
    r = constrained(1, "ab")
    s.add(r)
    s.schedule()
    assert s.update([1], [2])[0].finish_reason == "stop"  # "c": a broken executor's token
    assert 1 not in s.requests


@pytest.fixture
def grammars(tokenizer):
    g = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=2,
                 fill_threads=3)
    yield g
    g.close()


def test_compiles_are_cached_bounded_and_shared(grammars):
    async def run():
        a, b, c = (Constraint("regex", r) for r in ("[0-9]+", "x|y", "z+"))
        first = await asyncio.gather(*(grammars.compile(a) for _ in range(5)))
        assert grammars.num_compiled == 1 and all(x is first[0] for x in first)
        await grammars.compile(b)
        await grammars.compile(c)  # the cache holds 2: a goes
        assert await grammars.compile(b) is not None and grammars.num_compiled == 3
        await grammars.compile(a)
        assert grammars.num_compiled == 4

    asyncio.run(run())


def test_a_slow_compile_does_not_stall_the_event_loop(grammars):
    big = {"type": "object", "properties": {
        f"p{i}": {"type": "object", "properties": {
            f"q{j}": {"type": "string", "pattern": "[a-z]{3,9}"} for j in range(8)}}
        for i in range(8)}}

    async def run():
        ticks, gaps = 0, []
        task = asyncio.ensure_future(grammars.compile(Constraint("json_schema", json.dumps(big))))
        last = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last, ticks = now, ticks + 1
        await task
        return ticks, max(gaps)

    ticks, worst = asyncio.run(run())
    assert ticks >= 10 and worst < 0.25, (ticks, worst)


def test_errors_name_the_field_and_are_not_cached(grammars):
    async def run():
        for _ in range(2):
            with pytest.raises(InvalidRequest, match=r"^sampling\.grammar: EBNF parser error"):
                await grammars.compile(Constraint("grammar", "root ::= "))
        assert grammars.num_compiled == 2

    asyncio.run(run())


def test_fill_gives_the_matchers_allowed_tokens(grammars, tokenizer):
    async def run():
        return await grammars.compile(Constraint("choice", json.dumps(["yes", "no"])))

    m = grammars.matcher(asyncio.run(run()))
    bits = np.frombuffer(grammars.fill([m]), np.int32)
    assert len(bits) == (len(tokenizer) + 31) // 32
    allowed = {t for t in range(len(tokenizer)) if (int(bits[t // 32]) >> (t % 32)) & 1}
    assert {tokenizer.decode([t]) for t in allowed} == {"y", "ye", "yes", "n", "no"}


def test_the_batched_fill_gives_each_row_its_own_matchers_mask(grammars, tokenizer):
    """Rows in different states, on several threads: each the same as one matcher's own
    fill."""
    async def run():
        return [await grammars.compile(Constraint("regex", r)) for r in ("[0-9]+", "x|y")]

    digits, xy = asyncio.run(run())
    ms = [grammars.matcher(g) for g in (digits, xy, digits, xy, digits)]
    assert ms[2].accept_token(tokenizer.encode("7")[0])
    words = grammars.grammar_words
    batched = np.frombuffer(grammars.fill(ms), np.int32).reshape(len(ms), words)
    for m, row in zip(ms, batched, strict=True):
        one = xgr.allocate_token_bitmask(1, len(tokenizer))
        m.fill_next_token_bitmask(one, 0)
        assert np.array_equal(row, one[0].numpy())
    assert not np.array_equal(batched[0], batched[1])
    assert grammars.fill([]).shape == (0, words)


def test_the_batched_accept_says_which_rows_took_their_token(grammars, tokenizer):
    """All accepted (the one-call answer) and one refused (read row by row): each row's
    answer and state as xgrammar's own call leaves them."""
    import xgrammar as xgr

    async def run():
        return await grammars.compile(Constraint("regex", "[0-9]+"))

    digits = asyncio.run(run())
    seven, x = tokenizer.encode("7")[0], tokenizer.encode("x")[0]
    for tokens in ([seven, seven, seven], [seven, x, seven]):
        ours, theirs = ([grammars.matcher(digits) for _ in tokens] for _ in range(2))
        want = xgr.BatchGrammarMatcher.batch_accept_token(theirs, tokens)
        assert grammars.accept(ours, tokens) == want == [t == seven for t in tokens]
        masks = grammars.fill(ours), grammars.fill(theirs)
        assert np.array_equal(*masks)
    assert grammars.accept([], []) == []


def test_a_steps_constrained_tokens_are_accepted_in_one_call(monkeypatch):
    """One batched accept for the step's constrained rows (not a call per row); each row's
    refusal still ends only its own request."""
    from pagedserve.scheduler.grammar import Grammars

    calls = []
    real = Grammars.accept

    def counting(matchers, tokens):
        calls.append(list(tokens))
        return real(matchers, tokens)

    monkeypatch.setattr(Grammars, "accept", staticmethod(counting))
    s = make()
    for rid in (1, 2):
        s.add(constrained(rid, "ab"))
    s.add(Request(3, "r3", 2, [0, 1], GenerationParams(max_tokens=10), arrival_seq=3))
    s.schedule()
    out = s.update([1, 2, 3], [0, 2, 2])  # "a" fits; "c" is refused; 3 is unconstrained
    assert calls == [[0, 2]]
    assert [o.finish_reason for o in out] == [None, "stop", None]


def test_logits_past_the_tokenizer_are_never_allowed_and_not_xgrammars(tokenizer):
    """A model whose logits outnumber the tokenizer's ids (an embedding padded past it, or the
    benchmarks' 8B beside SmolLM2's tokenizer): xgrammar knows the tokenizer's ids only, and
    the rows end with them (the executor allows none of the logits past a row)."""
    n = len(tokenizer)
    wide = Grammars(tokenizer, n + 5000, [tokenizer.eos_token_id])
    exact = Grammars(tokenizer, n, [tokenizer.eos_token_id])
    try:
        assert wide.grammar_vocab == n and wide.grammar_words == (n + 31) // 32

        async def compiled(g):
            return await g.compile(Constraint("regex", "[0-9]{2,4}"))

        # three rows at different points of the match (rows are filled in one call)
        m_wide = [wide.matcher(asyncio.run(compiled(wide))) for _ in range(3)]
        m_exact = [exact.matcher(asyncio.run(compiled(exact))) for _ in range(3)]
        for step in range(4):
            got, want = wide.fill(m_wide), exact.fill(m_exact)
            assert got.shape == (3, exact.grammar_words)
            assert np.array_equal(got, want)
            digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(3)][:3 - step]
            n = len(digits)  # row i takes 3 - i digits: "0", "01", "012"
            assert Grammars.accept(m_wide[:n], digits[:n]) == Grammars.accept(
                m_exact[:n], digits[:n]) == [True] * n
    finally:
        wide.close()
        exact.close()
