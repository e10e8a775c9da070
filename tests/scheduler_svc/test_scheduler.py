from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import Request, RequestStatus, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=16, block_size=4, max_seqs=8, budget=16, watermark=0, threshold=0,
         caching=False):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=threshold, enable_prefix_caching=caching)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, watermark, caching))


def req(rid, prompt_len, priority=0, tokens=None):
    return Request(rid, f"r{rid}", prompt_len, tokens or [100 * rid + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=100), priority=priority, arrival_seq=rid)


def plan(out):
    """(kind, req_id, tokens, new blocks) in batch order."""
    from scheduler_svc.scheduler import SchedulerOutput

    assert isinstance(out, SchedulerOutput)
    return ([("new", r.req_id, n) for r, n in out.new]
            + [("cached", r.req_id, n, b) for r, n, b in out.cached])


def step(s, out, token=7):
    """Pretend the executor sampled `token` for every request that reached its end."""
    ids = [r.req_id for r, _ in out.scheduled() if r.num_computed_tokens == r.num_tokens]
    return s.update(ids, [token] * len(ids))


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
    assert s.waiting == [] and s.schedule().finished_req_ids == []


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
