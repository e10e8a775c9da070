from pagedserve.core.wire import PENDING_TOKEN
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.request import GenerationParams, Request, RequestStatus
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=16, block_size=4, max_seqs=8, budget=16, watermark=0, threshold=0,
         caching=False):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=threshold, enable_prefix_caching=caching)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, watermark, caching))


def req(rid, prompt_len, priority=0, tokens=None):
    return Request(rid, f"r{rid}", prompt_len, tokens or [100 * rid + i for i in range(prompt_len)],
                   GenerationParams(max_tokens=100), priority=priority, arrival_seq=rid)


def plan(out):
    """(kind, req_id, tokens, new blocks) in batch order."""
    assert isinstance(out, SchedulerOutput)
    return ([("new", s.req.req_id, s.num_tokens) for s in out.new]
            + [("cached", s.req.req_id, s.num_tokens, s.block_ids) for s in out.cached])


def step(s, out, token=7):
    """Pretend the executor sampled `token` for every request that reached its end."""
    ids = [s.req.req_id for s in out.scheduled() if s.req.num_computed_tokens == s.req.num_tokens]
    return [x.req for x in s.update(ids, [token] * len(ids))]


def test_long_prompt_is_chunked_and_decode_mixes_with_prefill():
    s = make(budget=8)
    a, b = req(1, 6), req(2, 10)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("new", 1, 6), ("new", 2, 2)]  # b gets the 2 tokens left
    assert s.blocks.block_table(1) == [0, 1] and s.blocks.block_table(2) == [2]
    assert [r.req_id for r in step(s, out)] == [1]  # only a finished its prompt
    out = s.schedule()
    # a decodes one token; b continues its prefill with the rest of the budget
    assert plan(out) == [("cached", 1, 1, []), ("cached", 2, 7, [3, 4])]
    step(s, out)
    out = s.schedule()
    assert plan(out) == [("cached", 1, 1, []), ("cached", 2, 1, [])]
    assert [r.req_id for r in step(s, out)] == [1, 2]
    assert a.num_computed_tokens == 8 and b.num_computed_tokens == 10
    assert a.token_ids[-2:] == [7, 7] and b.token_ids[-1] == 7


def test_max_num_seqs_and_budget_limit_admission():
    s = make(max_seqs=2, budget=100)
    for i in (1, 2, 3):
        s.add(req(i, 3))
    out = s.schedule()
    assert plan(out) == [("new", 1, 3), ("new", 2, 3)]
    assert [r.req_id for r in s.waiting] == [3]


def test_preemption_evicts_latest_and_recomputes():
    s = make(num_blocks=4, block_size=2, budget=16)
    a, b = req(1, 4), req(2, 4)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("new", 1, 4), ("new", 2, 4)]
    step(s, out)  # both now have 5 tokens, 4 computed; pool is full
    out = s.schedule()
    # a needs a third block: b (latest arrival) is preempted; its tail block goes to a
    assert plan(out) == [("cached", 1, 1, [3])]
    assert out.preempted_req_ids == [2]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.token_ids == [200, 201, 202, 203, 7]  # its generated token is kept, recomputed
    assert s.num_preemptions == 1
    step(s, out)
    s.finish(1)
    out = s.schedule()
    assert out.finished_req_ids == [1]
    assert plan(out) == [("new", 2, 5)]  # resumed: whole token list, from scratch
    assert s.blocks.block_table(2) == [2, 3, 1]  # free list was 2, then a's 3, 1, 0
    s.blocks.check_integrity()


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=3, block_size=2, budget=16)
    a, b = req(1, 4), req(2, 2)
    s.add(a)
    s.add(b)
    step(s, s.schedule())
    s.add(req(3, 1))
    out = s.schedule()
    assert out.preempted_req_ids == [2]
    assert [r.req_id for r in s.waiting] == [2, 3]


def test_priority_orders_queue_and_picks_victim():
    s = make(num_blocks=4, block_size=2, budget=16)
    low, high = req(1, 4, priority=5), req(2, 4, priority=0)
    s.add(low)
    s.add(high)
    out = s.schedule()
    assert plan(out) == [("new", 2, 4), ("new", 1, 4)]  # priority 0 first
    step(s, out)
    out = s.schedule()
    assert out.preempted_req_ids == [1]  # the low-priority one is the victim


def test_long_prefill_threshold_caps_chunks():
    s = make(budget=100, threshold=4)
    s.add(req(1, 10))
    assert plan(s.schedule()) == [("new", 1, 4)]


def test_finish_frees_blocks_and_reports_once():
    s = make()
    s.add(req(1, 5))
    out = s.schedule()
    step(s, out)
    s.finish(1)
    assert s.blocks.num_free_blocks == 16
    assert s.schedule().finished_req_ids == [1]
    assert s.schedule().finished_req_ids == []
    assert not s.has_work()


def test_abort_of_waiting_request():
    s = make(max_seqs=1)
    s.add(req(1, 2))
    s.add(req(2, 2))
    s.schedule()
    s.finish(2)  # never ran: nothing to tell the executor
    assert list(s.waiting) == [] and s.schedule().finished_req_ids == []


def test_prefix_cache_hit_skips_computed_tokens():
    s = make(budget=32, caching=True)
    shared = list(range(1000, 1008))  # two full blocks of 4
    a = req(1, 10, tokens=shared + [1, 2])
    s.add(a)
    out = s.schedule()
    assert plan(out) == [("new", 1, 10)]
    step(s, out)
    b = req(2, 11, tokens=shared + [7, 8, 9])
    s.add(b)
    out = s.schedule()
    # b starts with a's two blocks and computes only its last 3 prompt tokens
    assert plan(out) == [("new", 2, 3), ("cached", 1, 1, [])]
    assert s.blocks.block_table(2) == [0, 1, 3]
    assert b.num_computed_tokens == 11
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (21, 8)
    s.blocks.check_integrity()


def test_identical_prompts_in_one_step_share_blocks():
    s = make(budget=32, caching=True)
    s.add(req(1, 9, tokens=list(range(9))))
    s.add(req(2, 9, tokens=list(range(9))))
    out = s.schedule()
    # the second finds the first's blocks registered already: they are written earlier in the
    # same forward pass (each layer writes every row's K/V before attending)
    assert plan(out) == [("new", 1, 9), ("new", 2, 1)]
    assert s.blocks.block_table(2)[:2] == s.blocks.block_table(1)[:2]


def run_steps(s, n):
    for _ in range(n):
        step(s, s.schedule())


def test_high_priority_preempts_when_sequence_slots_are_full():
    s = make(max_seqs=2, budget=64, num_blocks=64)
    low1, low2 = req(1, 4, priority=5), req(2, 4, priority=5)
    s.add(low1)
    s.add(low2)
    run_steps(s, 3)
    vip = req(3, 4, priority=0)
    s.add(vip)
    out = s.schedule()
    # the newest low-priority request makes room; the VIP runs in this very step
    assert out.preempted_req_ids == [2]
    assert ("new", 3, 4) in plan(out)
    assert s.num_priority_preemptions == 1
    assert [r.req_id for r in s.running] == [3, 1]
    assert [r.req_id for r in s.waiting] == [2]


def test_high_priority_preempts_when_blocks_are_short():
    s = make(num_blocks=6, block_size=4, budget=64, max_seqs=8)
    s.add(req(1, 8, priority=1))
    s.add(req(2, 8, priority=2))
    run_steps(s, 1)  # 1 and 2 hold 3 blocks each (9 tokens)
    s.add(req(3, 8, priority=0))
    out = s.schedule()
    assert out.preempted_req_ids == [2]
    assert ("new", 3, 8) in plan(out)
    s.blocks.check_integrity()


def test_equal_priority_never_preempts_for_the_queue():
    s = make(max_seqs=1, budget=64)
    s.add(req(1, 4))
    run_steps(s, 2)
    s.add(req(2, 4))
    out = s.schedule()
    assert out.preempted_req_ids == [] and [r.req_id for r in s.waiting] == [2]


def test_a_queue_of_equal_priority_costs_no_work_per_running_request(monkeypatch):
    """Full sequence slots and a waiting request of the same priority: nothing can be
    preempted for it, so planning does not estimate every running request's growth (it did,
    every step: O(running) host work while a queue waits)."""
    s = make(max_seqs=8, budget=64, num_blocks=64)
    for i in range(1, 9):
        s.add(req(i, 4))
    run_steps(s, 2)
    s.add(req(9, 4))
    grown = []
    real = s.blocks.blocks_to_grow
    monkeypatch.setattr(s.blocks, "blocks_to_grow", lambda *a: grown.append(a) or real(*a))
    out = s.schedule()
    assert len(out.cached) == 8 and out.preempted_req_ids == [] and grown == []


def test_aging_lets_low_priority_overtake():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, priority_aging_steps=2,
                          enable_prefix_caching=False)
    s = Scheduler(cfg, BlockManager(64, 4, 0, False))
    s.add(req(1, 4, priority=0))
    s.schedule()
    old = req(2, 4, priority=3)
    s.add(old)  # queued at step 1
    run_steps(s, 4)
    s.add(req(3, 4, priority=1))  # queued at step 5: would go first without aging
    s.schedule()  # step 6: request 2 waited 5 steps -> effective priority 3 - 5 // 2 = 1
    assert old.effective_priority == 1
    assert [r.req_id for r in s.waiting] == [2, 3]  # same level: the earlier arrival first


def test_waiting_queue_bounds():
    s = Scheduler(SchedulerConfig(max_waiting_requests=2, max_waiting_prompt_tokens=10,
                                  enable_prefix_caching=False), BlockManager(8, 4))
    assert s.admission_error(4) is None
    s.add(req(1, 4))
    assert "max_waiting_prompt_tokens" in s.admission_error(7)
    s.add(req(2, 4))
    assert "max_waiting_requests" in s.admission_error(1)
    s.schedule()  # both admitted: the queue is empty again
    assert s.admission_error(4) is None and s.waiting.prompt_tokens == 0


def test_short_request_is_not_stuck_behind_a_long_prompt():
    s = make(num_blocks=128, budget=32, threshold=16)
    s.add(req(1, 300))
    out = s.schedule()
    assert plan(out) == [("new", 1, 16)]  # capped at the threshold, not the whole budget
    s.add(req(2, 5))
    out = s.schedule()
    assert plan(out) == [("new", 2, 5), ("cached", 1, 16, [4, 5, 6, 7])]
    assert [r.req_id for r in step(s, out)] == [2]  # its first token after one step


def make_swapping(mode="swap", host_blocks=8, min_tokens=256):
    from pagedserve.scheduler.block_manager import HostBlockPool

    cfg = SchedulerConfig(max_num_batched_tokens=16, enable_prefix_caching=False,
                          preemption_mode=mode, swap_min_tokens=min_tokens)
    return Scheduler(cfg, BlockManager(4, 2, 0, False), HostBlockPool(host_blocks))


def test_swap_preemption_copies_out_and_back_without_recompute():
    s = make_swapping()
    a, b = req(1, 4), req(2, 4)
    s.add(a)
    s.add(b)
    step(s, s.schedule())  # a: blocks [0, 1], b: [2, 3]; both have 5 tokens, 4 computed
    out = s.schedule()
    assert out.preempted_req_ids == [2]
    assert out.swap_out == [(2, 0), (3, 1)]  # b's two computed blocks -> host blocks 0, 1
    assert b.num_computed_tokens == 4 and b.swapped_blocks == [0, 1]
    assert plan(out) == [("cached", 1, 1, [3])]
    assert s.num_swap_preemptions == 1
    step(s, out)
    s.finish(1)  # free list: 2, then a's 3, 1, 0
    out = s.schedule()
    assert plan(out) == [("new", 2, 1)]  # resumed: only the uncomputed last token runs
    assert s.blocks.block_table(2) == [2, 3, 1]
    assert out.swap_in == [(0, 2), (1, 3)]
    assert b.swapped_blocks == [] and s.host_blocks.num_free_blocks == 8
    s.blocks.check_integrity()


def test_auto_mode_recomputes_short_contexts_and_when_host_is_full():
    s = make_swapping(mode="auto", min_tokens=4)
    s.add(req(1, 4))
    s.add(req(2, 2))
    step(s, s.schedule())
    out = s.schedule()
    assert out.preempted_req_ids == [2] and out.swap_out == []  # 2 computed tokens < 4
    s2 = make_swapping(mode="swap", host_blocks=1)
    s2.add(req(1, 4))
    s2.add(req(2, 4))
    step(s2, s2.schedule())
    out = s2.schedule()
    assert out.preempted_req_ids == [2] and out.swap_out == []  # needs 2 host blocks, has 1
    assert s2.requests[2].num_computed_tokens == 0


def test_aborting_a_swapped_request_frees_its_host_blocks():
    s = make_swapping()
    s.add(req(1, 4))
    s.add(req(2, 4))
    step(s, s.schedule())
    s.schedule()
    assert s.host_blocks.num_free_blocks == 6
    s.finish(2)
    assert s.host_blocks.num_free_blocks == 8


# ------------------------------------------------------------------ async scheduling
def test_ahead_plan_uses_placeholders_filled_by_results_in_order():
    s = make(budget=16, caching=True)
    a = req(1, 4)
    s.add(a)
    out1 = s.schedule()
    s.expect_tokens(out1)
    assert a.token_ids[-1] == PENDING_TOKEN and a.num_pending == 1
    out2 = s.schedule(ahead=True)  # before step 1's result: decodes the placeholder's position
    s.expect_tokens(out2)
    assert plan(out2) == [("cached", 1, 1, [1])]  # position 4 opens a second block
    assert a.num_pending == 2 and a.num_computed_tokens == 5
    assert [x.req for x in s.update([1], [41])] == [a]  # fills the oldest placeholder
    assert a.token_ids == [100, 101, 102, 103, 41, PENDING_TOKEN] and a.num_known_output_tokens == 1
    # the block [100..103] was registered at step 1; [41, ...] is not full yet
    assert s.blocks.num_cached_blocks == 1
    out3 = s.schedule(ahead=True)
    s.expect_tokens(out3)
    assert plan(out3) == [("cached", 1, 1, [])]
    s.update([1], [42])
    s.update([1], [43])
    assert a.token_ids == [100, 101, 102, 103, 41, 42, 43] and a.num_pending == 0
    s.blocks.check_integrity()


def test_ahead_plan_never_preempts():
    s = make(num_blocks=4, block_size=2, budget=16)
    a, b = req(1, 4), req(2, 4)
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.expect_tokens(out)
    # both need a third block for their 5th token and the pool is full: an ahead plan stops
    # instead of preempting a request whose step is in flight
    out = s.schedule(ahead=True)
    assert plan(out) == [] and out.preempted_req_ids == []
    assert a.status == b.status == RequestStatus.RUNNING
    s.update([1, 2], [7, 7])
    out = s.schedule()  # nothing in flight: the usual plan, which preempts b
    assert out.preempted_req_ids == [2] and plan(out) == [("cached", 1, 1, [3])]
    s.blocks.check_integrity()


def test_ahead_plan_waits_for_a_priority_preemption():
    s = make(max_seqs=1)
    low = req(1, 4, priority=5)
    s.add(low)
    s.expect_tokens(s.schedule())
    s.add(req(2, 4, priority=0))
    assert s.schedule(ahead=True).is_empty  # the head needs low's seat: wait for the result
    assert low.status == RequestStatus.RUNNING
    s.update([1], [7])
    out = s.schedule()
    assert out.preempted_req_ids == [1] and plan(out) == [("new", 2, 4)]


def test_no_placeholder_for_the_last_token_and_finish_drops_them():
    s = make()
    a = Request(1, "r1", 2, [5, 6], GenerationParams(max_tokens=2), arrival_seq=1)
    s.add(a)
    out = s.schedule()
    s.expect_tokens(out)
    assert a.num_pending == 1
    s.expect_tokens(s.schedule(ahead=True))
    assert a.num_pending == 1  # its second token is its last: nothing is planned past it
    assert s.schedule(ahead=True).is_empty
    s.update([1], [9])
    s.finish(1)  # e.g. EOS: the in-flight step's placeholder goes
    assert a.token_ids == [5, 6, 9]


def test_a_block_is_cached_only_once_its_placeholder_is_known():
    s = make(budget=16, caching=True)
    a = req(1, 3)
    s.add(a)
    s.expect_tokens(s.schedule())
    s.expect_tokens(s.schedule(ahead=True))  # computes position 3: block 0 full, one unknown
    assert a.num_computed_tokens == 4 and s.blocks.num_cached_blocks == 0
    s.update([1], [41])
    s.expect_tokens(s.schedule(ahead=True))
    assert s.blocks.num_cached_blocks == 1
    hit = s.blocks.cached_prefix([100, 101, 102, 41, 0])
    assert hit.blocks == tuple(s.blocks.block_table(1)[:1])


# ------------------------------------------------------------------ stop decisions
def test_update_decides_finishes_and_frees_their_blocks_at_once():
    s = make(budget=64)
    s.eos_token_ids = frozenset({2})
    reqs = [Request(1, "eos", 4, [1] * 4, GenerationParams(max_tokens=9), arrival_seq=1),
            Request(2, "stop-id", 4, [1] * 4, GenerationParams(max_tokens=9, stop_token_ids=(5,)),
                    arrival_seq=2),
            Request(3, "ignore-eos", 4, [1] * 4, GenerationParams(max_tokens=9, ignore_eos=True),
                    arrival_seq=3),
            Request(4, "length", 4, [1] * 4, GenerationParams(max_tokens=1), arrival_seq=4)]
    for r in reqs:
        s.add(r)
    s.schedule()
    got = s.update([1, 2, 3, 4], [2, 5, 2, 8])
    assert [(x.req.req_id, x.finish_reason, x.stop_reason) for x in got] == [
        (1, "stop", 2), (2, "stop", 5), (3, None, None), (4, "length", None)]
    assert [r.status for r in reqs] == [RequestStatus.FINISHED, RequestStatus.FINISHED,
                                        RequestStatus.RUNNING, RequestStatus.FINISHED]
    assert s.blocks.block_table(1) == [] and s.blocks.block_table(3) != []
    out = s.schedule()
    assert sorted(out.finished_req_ids) == [1, 2, 4] and plan(out) == [("cached", 3, 1, [4])]
    assert s.update([1], [7]) == []  # a late token of a finished request is dropped


def test_cached_requests_carry_where_their_tokens_start():
    s = make(budget=4)
    s.add(req(1, 6))
    first = s.schedule()
    assert [(x.start, x.num_tokens) for x in first.new] == [(0, 4)]
    second = s.schedule()
    assert [(x.start, x.num_tokens) for x in second.cached] == [(4, 2)]


def test_min_tokens_holds_eos_and_stop_ids_until_reached():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=False)
    s = Scheduler(cfg, BlockManager(16, 4, 0, False), eos_token_ids=[2])
    params = GenerationParams(max_tokens=10, min_tokens=3, stop_token_ids=(9,))
    r = Request(1, "r1", 3, [5, 6, 7], params)
    s.add(r)
    assert r.min_tokens_masked_ids == (2, 9)  # what the executor masks until then
    ends = []
    for tok in (2, 9, 2):  # tokens 1 and 2 cannot stop it; the third (EOS) does
        out = s.schedule()
        [sampled] = s.update([1], [tok]) if out.scheduled() else []
        ends.append(sampled.finish_reason)
    assert ends == [None, None, "stop"]
    ignoring = Request(2, "r2", 3, [5, 6, 7], GenerationParams(max_tokens=10, min_tokens=3,
                                                                ignore_eos=True))
    s.add(ignoring)
    assert ignoring.min_tokens_masked_ids == ()


def test_the_plan_carries_the_sampling_extras_to_the_executor():
    from pagedserve.executor.runner import sampling_spec
    from pagedserve.protos.internal.v1 import executor_pb2 as pb
    from pagedserve.scheduler.executor_link import encode_plan

    s = Scheduler(SchedulerConfig(enable_prefix_caching=False), BlockManager(16, 4, 0, False),
                  eos_token_ids=[2])
    params = GenerationParams(max_tokens=10, presence_penalty=0.5, frequency_penalty=-0.25,
                              repetition_penalty=1.5, min_p=0.125, logit_bias=((4, -3.0),),
                              min_tokens=2, logprobs=3)
    s.add(Request(1, "r1", 3, [5, 6, 7], params))
    plan = pb.SchedulerMessage.FromString(encode_plan(1, s.schedule())).plan
    new = plan.new_requests[0]
    assert new.num_prompt_tokens == 3
    spec = sampling_spec(new.sampling)
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty, spec.min_p,
            spec.logit_bias, spec.min_tokens, spec.min_tokens_masked_ids, spec.logprobs) == (
        0.5, -0.25, 1.5, 0.125, ((4, -3.0),), 2, (2,), 3)
    plain = sampling_spec(pb.Sampling())  # an unset repetition penalty is none, not 0
    assert not plain.penalized and plain.logprobs == -1


def test_completions_of_one_prompt_wait_for_its_first_and_share_its_blocks():
    """n = 3, a 10-token prompt prefilled in chunks of 4: completions 1 and 2 wait until
    completion 0 has scheduled its whole prompt, then take its two full blocks from the prefix
    cache and compute only the last 2 tokens; ending all of them frees every block."""
    s = make(budget=8, threshold=4, caching=True)
    first = req(1, 10, tokens=list(range(10)))
    kids = [req(i, 10, tokens=list(range(10))) for i in (2, 3)]
    for k in kids:
        k.first_sibling = first
    for r in (first, *kids):
        s.add(r)
    assert plan(s.schedule()) == [("new", 1, 4)]  # the budget had room for them: they wait
    assert plan(s.schedule()) == [("cached", 1, 4, [1])]
    out = s.schedule()
    assert plan(out) == [("new", 2, 2), ("new", 3, 2), ("cached", 1, 2, [2])]
    table = s.blocks.block_table(1)
    assert s.blocks.block_table(2)[:2] == s.blocks.block_table(3)[:2] == table[:2]
    assert len({table[2], s.blocks.block_table(2)[2], s.blocks.block_table(3)[2]}) == 3
    step(s, out)
    for r in (1, 2, 3):
        s.finish(r)
    s.check_idle(full=True)


def test_a_completion_does_not_wait_for_a_first_that_is_not_running():
    """Completion 0 preempted and requeued behind completion 1: waiting for it would wait
    forever (it cannot pass the head of the queue)."""
    s = make(budget=16, caching=True)
    first = Request(1, "r1", 6, list(range(6)), GenerationParams(max_tokens=100), arrival_seq=5)
    kid = req(2, 6, tokens=list(range(6)))
    kid.first_sibling = first
    s.add(first)
    s.add(kid)
    assert plan(s.schedule()) == [("new", 2, 6), ("new", 1, 2)]
