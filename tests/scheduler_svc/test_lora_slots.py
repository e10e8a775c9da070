"""LoRA slots in the scheduler: which adapter each device slot holds, loads in the plan,
least-recently-used reuse of free slots only, admission waiting for a slot, prefix-cache keys
per adapter."""

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.executor_link import encode_plan
from pagedserve.scheduler.lora_slots import LoraSlots
from pagedserve.scheduler.request import GenerationParams, Request
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig


def test_slots_are_reused_least_recently_used_first_and_never_while_held():
    s = LoraSlots(2)
    assert (s.take(7), s.take(8), s.take(7)) == (1, 2, 1)
    assert s.take_loads() == [(1, 7), (2, 8)]  # adapter 7 once, however many requests
    assert not s.can_take(9)  # both slots held
    s.release(2)
    assert s.can_take(9) and s.take(9) == 2  # the free one, though slot 1 was used earlier
    assert s.take_loads() == [(2, 9)]
    s.release(1)
    s.release(1)
    s.release(2)
    assert s.take(8) == 1  # slot 1 is the least recently used now
    assert s.take(9) == 2 and s.take_loads() == [(1, 8)]  # 9 still in slot 2: no load
    assert s.residents() == {8: 1, 9: 2} and s.in_use() == {8, 9}


def make(max_loras=1, caching=False):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                          enable_prefix_caching=caching, max_loras=max_loras,
                          lora_modules=(("a", "/a"), ("b", "/b")))
    return Scheduler(cfg, BlockManager(32, 4, 0, caching))


def req(rid, lora_id, tokens=None, priority=0):
    tokens = tokens or [100 * rid + i for i in range(6)]
    return Request(rid, f"r{rid}", len(tokens), tokens, GenerationParams(max_tokens=4),
                   arrival_seq=rid, lora_id=lora_id, priority=priority)


def test_a_request_waits_for_a_slot_and_the_plan_loads_it():
    s = make(max_loras=1)
    for r in (req(1, 1), req(2, 0), req(3, 2), req(4, 1)):
        s.add(r)
    out = s.schedule()
    # the base needs no slot; adapter 2 finds the only slot running adapter 1: the queue's
    # head waits there (order kept), and request 4 behind it too
    assert [x.req.req_id for x in out.new] == [1, 2]
    assert out.lora_loads == [(1, 1)]
    plan = pb.SchedulerMessage.FromString(encode_plan(1, out)).plan
    assert [(n.req_id, n.lora_slot) for n in plan.new_requests] == [(1, 1), (2, 0)]
    assert [(x.slot, x.adapter_id) for x in plan.lora_loads] == [(1, 1)]
    s.finish(1)
    out = s.schedule()
    assert [x.req.req_id for x in out.new] == [3] and out.lora_loads == [(1, 2)]
    assert s.requests[3].lora_slot == 1
    s.finish(3)
    out = s.schedule()
    assert [x.req.req_id for x in out.new] == [4] and out.lora_loads == [(1, 1)]


def test_the_base_passes_a_request_waiting_for_a_slot_other_adapters_do_not():
    """Behind a request waiting for a slot, the base's requests are admitted (they hold no
    slot) but an adapter's are not, even one whose adapter is in a slot: the slot drains."""
    s = make(max_loras=1)
    for r in (req(1, 1), req(2, 2), req(3, 0), req(4, 1), req(5, 0)):
        s.add(r)
    out = s.schedule()
    assert [x.req.req_id for x in out.new] == [1, 3, 5]
    assert [r.req_id for r in s.waiting] == [2, 4]
    s.finish(1)
    out = s.schedule()
    assert [x.req.req_id for x in out.new] == [2] and out.lora_loads == [(1, 2)]


def test_the_walk_past_a_waiting_request_ends_at_the_last_base_request():
    """Admission does not read the queue behind a request waiting for a slot once no base
    request is left there: a step costs O(running), not O(waiting)."""
    s = make(max_loras=1)
    for i, lora in enumerate([1, 2, 0] + [2] * 500 + [0] + [2] * 500, start=1):
        s.add(req(i, lora))
    read = []
    at = s.waiting.at
    s.waiting.at = lambda i: read.append(i) or at(i)
    out = s.schedule()
    assert [x.req.req_id for x in out.new] == [1, 3, 504]
    assert max(read) == 501 and s.waiting.base == 0  # 504 at 501: 1 and 3 left before it
    read.clear()
    s.schedule()
    assert read == [0]  # request 2 waits; no base request behind it


def test_a_more_important_request_takes_a_slot_from_less_important_ones():
    """Priority preemption frees a LoRA slot as it frees blocks: the head's adapter finds both
    slots held; the slot whose holders are all less important and fewest is emptied."""
    s = make(max_loras=2)
    for r in (req(1, 1, priority=5), req(2, 1, priority=5), req(3, 2, priority=5)):
        s.add(r)
    s.schedule()
    assert [r.lora_slot for r in (s.requests[1], s.requests[2], s.requests[3])] == [1, 1, 2]
    s.add(req(4, 3, priority=0))
    assert s.schedule(ahead=True).new == []  # async: wait for the step in flight, then preempt
    out = s.schedule()
    assert out.preempted_req_ids == [3] and s.num_priority_preemptions == 1
    assert [x.req.req_id for x in out.new] == [4] and out.lora_loads == [(2, 3)]
    assert [r.req_id for r in s.running] == [4, 1, 2]
    s.add(req(5, 2, priority=5))  # an equal priority preempts nobody: it waits
    assert s.schedule().preempted_req_ids == [] and 5 in {r.req_id for r in s.waiting}


def test_a_preempted_request_gives_its_slot_back():
    s = make(max_loras=1)
    s.add(req(1, 1))
    s.schedule()
    s._preempt(s.requests[1])
    assert s.requests[1].lora_slot == 0 and s.lora.can_take(2)


def test_the_same_tokens_under_two_adapters_share_no_block():
    s = make(max_loras=2, caching=True)
    tokens = list(range(10, 26))  # four full blocks of 4
    s.add(req(1, 1, tokens))
    s.schedule()
    s.finish(1)  # its blocks stay cached
    s.add(req(2, 2, tokens))
    s.schedule()
    assert s.requests[2].num_computed_tokens == 16 and s.prefix_hit_tokens == 0
    s.add(req(3, 1, tokens))
    s.schedule()
    assert s.prefix_hit_tokens == 12  # adapter 1's blocks (all but the last prompt token's)


def test_the_adapters_in_use_are_one_lora_requests_info_series():
    """vLLM's gauge, which the Inference Extension's endpoint picker reads: the running and the
    waiting requests' adapters by name; a change replaces the series."""
    from prometheus_client import CollectorRegistry

    from pagedserve.scheduler.metrics import Metrics
    from pagedserve.scheduler.telemetry import Telemetry

    s = make(max_loras=1)
    for r in (req(1, 1), req(2, 2), req(3, 0)):
        s.add(r)
    s.schedule()
    st = s.stats()
    assert (st.max_loras, st.running_lora, st.waiting_lora) == (1, ("a",), ("b",))
    metrics = Metrics("m", CollectorRegistry())
    telemetry = Telemetry(metrics)

    def series():
        [family] = metrics.lora_info.collect()
        return [(x.labels["max_lora"], x.labels["running_lora_adapters"],
                 x.labels["waiting_lora_adapters"]) for x in family.samples]

    telemetry.observe_scheduler(st)
    assert series() == [("1", "a", "b")]
    s.finish(1)
    s.schedule()
    telemetry.observe_scheduler(s.stats())
    assert series() == [("1", "b", "")]
    assert make(max_loras=0).stats().max_loras == 0  # LoRA off: no series


def test_a_request_that_does_not_fit_takes_no_slot_and_queues_no_load():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_loras=1,
                          lora_modules=(("a", "/a"),))
    s = Scheduler(cfg, BlockManager(2, 4, 0, False))  # 8 tokens of KV: a 12-token prompt
    s.add(req(1, 1, list(range(12))))  # never fits
    out = s.schedule()
    assert out.new == [] and out.lora_loads == [] and s.requests[1].lora_slot == 0
    assert s.lora.can_take(2)  # the slot is free for anyone


def test_a_failed_step_empties_the_slots_it_was_to_load():
    s = LoraSlots(2)
    s.take(7)
    loads = s.take_loads()
    s.release(1)
    s.invalidate(loads)
    assert s.residents() == {}
    slot = s.take(7)  # loaded again, in whichever slot
    assert s.take_loads() == [(slot, 7)]
