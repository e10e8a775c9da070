"""--long-prefill-decode-share: a partial prefill's chunks wait while the decoders' share of
time is spent (scheduler_svc/prefill_share.py)."""

import logging

import pytest

from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.prefill_share import PrefillShare
from pagedserve.scheduler.request import GenerationParams, Request
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig


def test_chunked_steps_are_repaid_by_the_share_of_plain_decode_steps():
    g = PrefillShare(0.5)
    assert g.open
    g.observe(0.030, decoding=True, chunked=True, held=False)  # no plain step known: all of it
    assert g.credit == pytest.approx(-0.030) and not g.open
    g.observe(0.010, decoding=True, chunked=False, held=True)
    assert (g.decode_s, g.credit) == (pytest.approx(0.010), pytest.approx(-0.025))
    g.observe(0.020, decoding=True, chunked=False, held=True)  # the average moves by 0.2
    assert (g.decode_s, g.credit) == (pytest.approx(0.012), pytest.approx(-0.015))
    g.observe(0.052, decoding=True, chunked=True, held=False)  # 0.040 beyond a plain step
    assert g.credit == pytest.approx(-0.055)
    g.observe(0.012, decoding=True, chunked=False, held=False)  # nothing held: nothing repaid
    assert g.credit == pytest.approx(-0.055)
    for _ in range(10):
        g.observe(0.012, decoding=True, chunked=False, held=True)
    assert g.credit == 0.0 and g.open  # repaid, and never banked past zero
    g.observe(0.2, decoding=True, chunked=True, held=False)
    g.observe(0.1, decoding=False, chunked=True, held=False)  # nobody decodes: debt forgiven
    assert g.open


def test_a_stalled_plain_step_counts_as_at_most_twice_the_average():
    g = PrefillShare(0.5, decode_s=0.010)
    g.observe(2.0, decoding=True, chunked=False, held=False)  # a kernel compiled: 2 s
    assert g.decode_s == pytest.approx(0.012)  # 0.8 x 0.010 + 0.2 x 0.020
    g.observe(0.030, decoding=True, chunked=True, held=False)  # so a chunk still costs
    assert g.credit == pytest.approx(-0.018) and not g.open
    g.observe(1.0, decoding=True, chunked=False, held=True)  # and a stall repays as much
    assert g.credit == pytest.approx(-0.018 + 0.5 * 0.024)
    for _ in range(12):  # a plain step that really grew is followed within a few steps
        g.observe(0.050, decoding=True, chunked=False, held=False)
    assert 0.045 < g.decode_s < 0.050


def test_each_stretch_logs_its_steps_by_kind(caplog):
    g = PrefillShare(0.5, decode_s=0.010)
    with caplog.at_level(logging.INFO, logger="pagedserve.scheduler"):
        g.observe(0.050, decoding=True, chunked=True, held=False)
        for took in (0.020, 0.010, 0.012, 0.012):  # two behind the chunk, then two held
            g.observe(took, decoding=True, chunked=False, held=True)
        assert not caplog.records
        g.observe(0.010, decoding=True, chunked=False, held=False)  # the prefill is done
        g.observe(0.010, decoding=True, chunked=False, held=False)  # (once)
    assert caplog.messages == [
        "prefill share 0.50: 1 steps chunked 0.05 s (50.0 ms each), 2 steps after a chunk "
        "0.03 s (15.0 ms each), 2 steps held 0.02 s (12.0 ms each); a plain step 11.74 ms"]


def req(rid, prompt_len, priority=0):
    return Request(rid, f"r{rid}", prompt_len, [100 * rid + i for i in range(prompt_len)],
                   GenerationParams(max_tokens=100), priority=priority, arrival_seq=rid)


def plan(out):
    return [(s.req.req_id, s.num_tokens) for s in out.scheduled()]


def step(s, out, seconds=None):
    """The executor samples 7 for every request at its end; the result took `seconds`."""
    ids = [x.req.req_id for x in out.scheduled() if x.req.num_computed_tokens == x.req.num_tokens]
    s.update(ids, [7] * len(ids))
    if seconds is not None:
        s.prefill_share.observe(seconds, decoding=out.decoding, chunked=out.chunked,
                                held=out.held_chunks > 0)


def test_a_long_prompts_later_chunks_wait_for_the_decoders_and_its_first_does_not():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                          long_prefill_token_threshold=4, long_prefill_decode_share=0.5)
    s = Scheduler(cfg, BlockManager(32, 4, 0, False))
    s.add(req(1, 3))
    step(s, s.schedule())  # a's prompt; a decodes from now on
    s.add(req(2, 16))
    out = s.schedule()
    assert plan(out) == [(2, 4), (1, 1)]  # b's first chunk joins at once
    assert (out.decoding, out.chunked, out.held_chunks) == (True, False, 0)
    step(s, out, 0.010)  # a plain decode step: 10 ms
    out = s.schedule()
    assert plan(out) == [(1, 1), (2, 4)] and out.chunked  # the share is not spent yet
    step(s, out, 0.030)  # 20 ms beyond a plain step: 40 ms of plain steps at 0.5 repay it
    plans = []
    for took in (0.010, 0.010, 0.010, 0.010, 0.030):
        out = s.schedule()
        plans.append((plan(out), out.held_chunks))
        step(s, out, took)
    assert plans == [([(1, 1)], 1)] * 4 + [([(1, 1), (2, 4)], 0)]
    assert s.stats().held_chunks == 4
    assert not s.prefill_share.open
    s.finish(1)  # a ends: with nobody decoding, b's last chunk is not held
    out = s.schedule()
    assert plan(out) == [(2, 4)] and not out.decoding


def test_a_more_important_prompt_is_not_held_for_less_important_decoders():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                          long_prefill_token_threshold=4, long_prefill_decode_share=0.5)
    s = Scheduler(cfg, BlockManager(32, 4, 0, False))
    s.add(req(1, 3, priority=5))
    step(s, s.schedule())
    s.add(req(2, 16))  # priority 0
    step(s, s.schedule(), 0.010)
    s.prefill_share.credit = -1.0  # the share is spent
    out = s.schedule()
    assert plan(out) == [(2, 4), (1, 1)] and out.held_chunks == 0
    assert not out.chunked  # nor does its time count against the share
    s.add(req(3, 3))  # a decoder as important as the prompt: now it waits
    step(s, out)
    step(s, s.schedule())  # the new one's prompt
    out = s.schedule()
    assert plan(out) == [(3, 1), (1, 1)] and out.held_chunks == 1
