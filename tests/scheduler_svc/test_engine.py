"""The engine's step loop against a fake executor link: no sockets, no processes; the test
decides when each step's result arrives, when a step times out and when an executor joins."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import xgrammar as xgr

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.api.streams import Chunk, OutputProcessor
from pagedserve.scheduler.capacity import fit_step_bounds
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.engine_client import EngineClient
from pagedserve.scheduler.engine_io import EngineError, EngineRequest
from pagedserve.scheduler.executor_link import (
    LinkConfig,
    LinkDown,
    encode_bitmask,
    encode_plan,
)
from pagedserve.scheduler.request import GenerationParams
from pagedserve.scheduler.scheduler import SchedulerConfig

CAP = pb.Capacity(num_kv_blocks=32, block_size=4, max_model_len=64, vocab_size=100)
TOKEN = 7


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeLink:
    """ExecutorLink's interface; records each plan as the executor would receive it."""

    def __init__(self) -> None:
        self.cfg = LinkConfig(step_timeout_s=5.0)
        self.results: asyncio.Queue = asyncio.Queue()
        self.result_at = 0.0
        self.connected = asyncio.Event()
        self.capacity: pb.Capacity | None = None
        self.generation = 0
        self.sent: list[tuple[int, pb.StepPlan, list[int]]] = []  # (step, plan, samplers)
        self.new_plan = asyncio.Event()
        self.masks: dict[int, pb.StepBitmask] = {}  # by step id
        self.events: list[tuple[str, int]] = []  # ("plan" | "mask" | "result", step id)

    def attach(self, on_joined, on_lost) -> None:
        self.on_joined, self.on_lost = on_joined, on_lost

    async def start(self) -> list:
        return []

    async def close(self) -> None:
        pass

    async def send(self, step_id, out) -> None:
        plan = pb.SchedulerMessage.FromString(encode_plan(step_id, out)).plan
        samplers = [s.req.req_id for s in out.scheduled()
                    if s.start + s.num_tokens == len(s.req.token_ids)]
        self.sent.append((step_id, plan, samplers))
        self.events.append(("plan", step_id))
        self.new_plan.set()

    async def send_bitmask(self, step_id, req_ids, bits) -> None:
        msg = pb.SchedulerMessage.FromString(encode_bitmask(step_id, req_ids,
                                                            bytes(bits))).bitmask
        self.masks[step_id] = msg
        self.events.append(("mask", step_id))

    # -------------------------------------------------------------- the test's side
    def join(self) -> None:
        if self.connected.is_set():  # replaces the current executor
            self.results.put_nowait(LinkDown("replaced by a new executor", self.generation))
            self.generation += 1
        self.generation += 1
        self.capacity = CAP
        self.on_joined(CAP)
        self.connected.set()

    def time_out(self, step_id: int) -> None:
        self.results.put_nowait(LinkDown("timed out", self.generation, step_id))
        self.generation += 1
        self.connected.clear()
        self.on_lost("timed out")

    def answer(self, index: int) -> None:
        """TOKEN for each request that samples; a constrained one (as an executor would, only
        once the step's bitmask arrived) the lowest token its row allows."""
        step_id, plan, samplers = self.sent[index]
        tokens = [TOKEN] * len(samplers)
        if plan.bitmask_follows:
            mask = self.masks[step_id]
            words = np.frombuffer(mask.token_bitmask, np.int32).reshape(len(mask.req_ids), -1)
            for rid, row in zip(mask.req_ids, words, strict=True):
                bits = np.unpackbits(row.view(np.uint8), bitorder="little")
                tokens[samplers.index(rid)] = int(np.flatnonzero(bits)[0])
        self.events.append(("result", step_id))
        self.results.put_nowait(pb.StepResult(step_id=step_id, req_ids=samplers,
                                              sampled_token_ids=tokens))

    async def wait_sent(self, n: int) -> None:
        while len(self.sent) < n:
            self.new_plan.clear()
            await asyncio.wait_for(self.new_plan.wait(), 5)
        await asyncio.sleep(0.01)  # let the loop plan more if it would (it must not)


async def started(async_scheduling: bool = False) -> tuple[Engine, FakeLink]:
    link = FakeLink()
    engine = Engine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), link,
                    CharTokenizer(), eos_token_ids=[2], async_scheduling=async_scheduling)
    await engine.start()
    link.join()
    _outputs[id(engine)] = OutputProcessor(EngineClient(engine), CharTokenizer())
    return engine, link


_outputs: dict[int, OutputProcessor] = {}  # each engine's front end, by id(engine)


def submit(engine: Engine, rid: str, prompt: list[int], params: GenerationParams,
           grammar=None):
    """Queue a request with the engine, and open its stream in the front end."""
    req_id = engine.submit(EngineRequest(rid, prompt, params), grammar)
    return _outputs[id(engine)].open(req_id, rid, prompt, params)


async def collect(stream) -> Chunk | EngineError:
    """All of a stream's chunks as one, or the error that ended it."""
    whole = None
    while True:
        item = await asyncio.wait_for(stream.queue.get(), 5)
        if isinstance(item, EngineError):
            return item
        whole = item if whole is None else whole.then(item)
        if whole.finish_reason:
            return whole


def run(coro):
    return asyncio.run(coro)


def test_async_scheduling_plans_a_step_ahead_and_delivers_in_order():
    async def main():
        engine, link = await started(async_scheduling=True)
        params = GenerationParams(max_tokens=3, temperature=0)
        streams = [submit(engine, f"r{i}", [10 + i] * 5, params) for i in range(2)]
        await link.wait_sent(2)
        assert len(link.sent) == 2  # two in flight, none answered: depth 2
        first = link.sent[0][1]
        # the new requests went out whole, without the pending tokens added after sending
        assert [list(r.token_ids) for r in first.new_requests] == [[10] * 5, [11] * 5]
        second = link.sent[1][1]
        assert list(second.cached_req_ids) == [1, 2]
        assert list(second.cached_num_computed_tokens) == [5, 5]
        link.answer(0)  # frees a slot in flight: step 3 samples the third and last token
        await link.wait_sent(3)
        link.answer(1)
        link.answer(2)
        got = [await collect(s) for s in streams]
        assert [(c.token_ids, c.text, c.finish_reason, c.completion_tokens) for c in got] == \
            [([TOKEN] * 3, "hhh", "length", 3)] * 2
        # the third token was each request's last: step 4 only tells the executor so
        last = link.sent[3][1]
        assert len(link.sent) == 4 and list(last.finished_req_ids) == [1, 2]
        assert not last.new_requests and not last.cached_req_ids
        engine.scheduler.check_idle(full=True)
        await engine.close()

    run(main())


def test_a_long_prompts_chunk_that_slowed_the_decoders_waits_for_them():
    """--long-prefill-decode-share: the engine times each step from result to result; after
    a chunked step 50 ms slower than a plain one the next plan holds the chunk back."""
    async def main():
        link = FakeLink()
        engine = Engine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                        long_prefill_token_threshold=4,
                                        long_prefill_decode_share=0.5),
                        link, CharTokenizer(), eos_token_ids=[2])
        await engine.start()
        link.join()
        _outputs[id(engine)] = OutputProcessor(EngineClient(engine), CharTokenizer())
        submit(engine, "a", [10] * 3, GenerationParams(max_tokens=20, temperature=0))
        await link.wait_sent(1)
        link.answer(0)  # a's prompt: a decodes from now on
        submit(engine, "b", [11] * 16, GenerationParams(max_tokens=2, temperature=0))
        await link.wait_sent(2)
        link.answer(1)  # a decodes and b's first chunk (never held) is in: a plain step
        await link.wait_sent(3)
        await asyncio.sleep(0.05)
        link.answer(2)  # a and b's second chunk, 50 ms
        await link.wait_sent(4)
        plans = [(list(p.cached_req_ids), list(p.cached_num_scheduled_tokens))
                 for _, p, _ in link.sent[1:4]]
        assert plans == [([1], [1]), ([1, 2], [1, 4]), ([1], [1])]
        assert engine.scheduler.stats().held_chunks == 1
        await engine.close()

    run(main())


def test_a_request_in_two_steps_that_time_out_fails_and_a_new_executor_serves_on():
    async def main():
        engine, link = await started()
        stream = submit(engine, "slow", [5] * 4, GenerationParams(max_tokens=4, temperature=0))
        await link.wait_sent(1)
        link.time_out(link.sent[0][0])  # a stall: recomputed on the next executor
        assert not engine.serving and stream.queue.empty()
        link.join()
        await link.wait_sent(2)
        assert [r.req_id for r in link.sent[1][1].new_requests] == [1]
        link.time_out(link.sent[1][0])  # it hangs that one too: it fails
        err = await collect(stream)
        assert isinstance(err, EngineError) and err.code == "UNAVAILABLE"
        assert str(err) == ("the executor did not answer a step with this request within 5 s, "
                            "twice")
        link.join()  # a new executor
        assert engine.serving
        stream = submit(engine, "next", [6] * 4, GenerationParams(max_tokens=1, temperature=0))
        await link.wait_sent(3)
        assert [r.req_id for r in link.sent[2][1].new_requests] == [2]
        link.answer(2)
        assert (await collect(stream)).finish_reason == "length"
        engine.scheduler.check_idle(full=True)
        await engine.close()

    run(main())


def test_an_executor_joining_mid_step_gets_the_requests_recomputed():
    async def main():
        engine, link = await started()
        stream = submit(engine, "r", [5] * 6, GenerationParams(max_tokens=2, temperature=0))
        await link.wait_sent(1)
        link.answer(0)  # first token
        await link.wait_sent(2)
        link.join()  # replaced while step 2 is in flight: its answer never comes
        await link.wait_sent(3)
        plan = link.sent[2][1]  # recompute: prompt and the token so far, from position 0
        assert [(list(r.token_ids), r.num_computed_tokens) for r in plan.new_requests] == \
            [([5] * 6 + [TOKEN], 0)]
        link.answer(2)
        got = await collect(stream)
        assert (got.token_ids, got.finish_reason) == ([TOKEN, TOKEN], "length")
        await engine.close()

    run(main())


# a toy vocabulary of CAP's 100 tokens for grammars: 0 "a", 1 "b", 2 the EOS, then "c".."z"
# and strings no regex below matches
VOCAB = ["a", "b", "</s>", *"cdefghijklmnopqrstuvwxyz"] + [f"<{i}>" for i in range(26, 100)]


def grammar(regex: str):
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[2])
    return xgr.GrammarCompiler(info).compile_regex(regex)


def test_async_scheduling_plans_a_constrained_request_on_every_step():
    """Its mask for step N+1 is filled once step N's token is back, and sent before any later
    plan; the executor waits for it only before sampling."""
    async def main():
        engine, link = await started(async_scheduling=True)
        params = GenerationParams(max_tokens=5, temperature=0)
        json_ = submit(engine, "c", [10] * 3, params, grammar=grammar("b[ab]*"))
        plain = submit(engine, "p", [11] * 3, params)
        for i in range(5):  # step 5 samples the last tokens: nothing is planned behind it
            await link.wait_sent(min(i + 2, 5))
            link.answer(i)
        got = [await collect(s) for s in (json_, plain)]
        assert [(c.token_ids, c.finish_reason) for c in got] == \
            [([1, 0, 0, 0, 0], "length"), ([TOKEN] * 5, "length")]
        # both sample in each of the five steps: the constrained one is never skipped
        assert [samplers for _, _, samplers in link.sent[:5]] == [[1, 2]] * 5
        assert [p.bitmask_follows for _, p, _ in link.sent] == [True] * 5 + [False]
        assert [list(link.masks[s].req_ids) for s in range(1, 6)] == [[1]] * 5
        # step 1's mask at once (nothing in flight); step N+1's after N's result, before any
        # later plan; step 6 only tells the executor that both finished
        assert link.events == [("plan", 1), ("mask", 1), ("plan", 2),
                               *[e for n in range(1, 4)
                                 for e in (("result", n), ("mask", n + 1), ("plan", n + 2))],
                               ("result", 4), ("mask", 5), ("result", 5), ("plan", 6)]
        engine.scheduler.check_idle(full=True)
        await engine.close()

    run(main())


def test_a_step_whose_constrained_requests_ended_still_gets_its_mask_message():
    """Aborted after step 2 was planned, before step 1's result: the executor waits for step
    2's mask all the same, so it comes, with no rows."""
    async def main():
        engine, link = await started(async_scheduling=True)
        stream = submit(engine, "c", [10] * 3, GenerationParams(max_tokens=5, temperature=0),
                               grammar=grammar("[ab]+"))
        await link.wait_sent(2)
        engine.abort(stream.req_id)
        link.answer(0)
        await link.wait_sent(3)
        assert list(link.masks[2].req_ids) == [] and link.masks[2].token_bitmask == b""
        assert link.events[:5] == [("plan", 1), ("mask", 1), ("plan", 2), ("result", 1),
                                   ("mask", 2)]
        assert list(link.sent[2][1].finished_req_ids) == [1]
        await engine.close()

    run(main())


@pytest.mark.parametrize("limit,seqs,want", [(4096, 512, (4096, 256)), (0, 0, (8192, 256))])
def test_step_bounds_are_lowered_to_what_the_executor_profiled(limit, seqs, want):
    cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    got = fit_step_bounds(cfg, pb.Capacity(max_num_batched_tokens=limit, max_num_seqs=seqs))
    assert (got.max_num_batched_tokens, got.max_num_seqs) == want  # 0: not profiled (CPU)


@pytest.mark.parametrize("limit,seqs,want", [(8192, 1024, (8192, 1024)), (2048, 256, (2048, 256)),
                                             (0, 0, (2048, 128))])
def test_step_bounds_left_to_the_device_take_the_executors(limit, seqs, want):
    """The flags' default 0: the executor's bounds for its card, or the CPU's on a CPU."""
    cfg = SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=0)
    got = fit_step_bounds(cfg, pb.Capacity(max_num_batched_tokens=limit, max_num_seqs=seqs))
    assert (got.max_num_batched_tokens, got.max_num_seqs) == want


def test_a_draft_models_proposals_reach_the_next_plan_and_need_its_executor(monkeypatch):
    """--speculative-config draft_model: an executor without the draft stops the engine (one
    line, exit 2); one with it gets each step's lookahead, and its proposals come back as the
    next step's drafts."""
    import pagedserve.scheduler.engine as engine_module
    from pagedserve.core.speculative import SpeculativeConfig

    exits: list[int] = []
    monkeypatch.setattr(engine_module.os, "_exit", exits.append)

    async def main():
        link = FakeLink()
        spec = SpeculativeConfig.parse('{"model": "d", "num_speculative_tokens": 2}')
        engine = Engine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                        speculative=spec), link, CharTokenizer(),
                        eos_token_ids=[2])
        await engine.start()
        link.join()  # CAP names no draft
        assert exits == [2]
        engine._joined(pb.Capacity(num_kv_blocks=32, block_size=4, max_model_len=64,
                                   vocab_size=100, draft_model="d"))
        assert exits == [2]
        _outputs[id(engine)] = OutputProcessor(EngineClient(engine), CharTokenizer())
        stream = submit(engine, "r", [10] * 5, GenerationParams(max_tokens=8, temperature=0))
        await link.wait_sent(1)
        step_id, plan, _ = link.sent[0]
        assert plan.num_lookahead_tokens == 2
        link.results.put_nowait(pb.StepResult(step_id=step_id, req_ids=[1],
                                              sampled_token_ids=[TOKEN], draft_req_ids=[1],
                                              num_draft_tokens=[2], draft_token_ids=[5, 6]))
        await link.wait_sent(2)
        plan = link.sent[1][1]
        assert list(plan.cached_spec_token_ids) == [5, 6]
        assert list(plan.cached_num_scheduled_tokens) == [3]
        link.results.put_nowait(pb.StepResult(step_id=link.sent[1][0], req_ids=[1, 1],
                                              sampled_token_ids=[5, TOKEN]))  # one kept
        await link.wait_sent(3)
        assert list(link.sent[2][1].cached_num_computed_tokens) == [7]
        assert not link.sent[2][1].cached_spec_token_ids  # no proposals came
        assert stream.queue.qsize() > 0  # the tokens reached the front end

    run(main())
