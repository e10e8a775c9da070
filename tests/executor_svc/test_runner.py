"""The runner checks each plan against its mirror of the scheduler's request state."""

import pytest

from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from tests.executor_svc.test_model_gpu import save_random_llama


def decode(step_id, req_ids, computed):
    return pb.StepPlan(step_id=step_id, cached_req_ids=req_ids,
                       cached_num_computed_tokens=computed,
                       cached_num_scheduled_tokens=[1] * len(req_ids),
                       cached_num_new_blocks=[0] * len(req_ids))


def test_a_plan_that_disagrees_with_the_mirror_fails_with_the_request_named(tmp_path):
    save_random_llama(tmp_path, "d64")
    runner = Worker(ExecutorConfig(model=str(tmp_path), device="cpu", num_kv_blocks=8)).runner
    prefill = pb.StepPlan(step_id=1)
    prefill.new_requests.add(req_id=3, token_ids=[5, 6, 7], block_ids=[0, 1],
                             sampling=pb.Sampling(temperature=0.0, top_p=1.0))
    prefill.new_num_scheduled_tokens.append(3)
    assert runner.execute(prefill)[0] == [3]
    assert runner.execute(decode(2, [3], [3]))[0] == [3]  # 3 computed: agrees
    with pytest.raises(ValueError, match="request 3: the scheduler has 3 computed tokens, this "
                                         "executor 4: the mirrors drifted"):
        runner.execute(decode(3, [3], [3]))
    with pytest.raises(ValueError, match="request 9: planned as cached, but this executor does "
                                         "not hold it"):
        runner.execute(decode(4, [9], [0]))


def step_plan(step_id, new=(), cached=(), finished=()):
    """new: (req_id, token ids, block) each; cached: (req_id, computed) each, one token."""
    plan = decode(step_id, [r for r, _ in cached], [c for _, c in cached])
    plan.finished_req_ids[:] = list(finished)
    for rid, tokens, block in new:
        plan.new_requests.add(req_id=rid, token_ids=tokens, block_ids=[block],
                              sampling=pb.Sampling(temperature=0.0, top_p=1.0))
        plan.new_num_scheduled_tokens.append(len(tokens))
    return plan


def test_decode_inputs_come_from_whichever_unfinished_launch_sampled_them(tmp_path):
    """Launches run ahead of finish(): a decode row reads its input from the launch that
    sampled it (two different ones in step 3), and finishing an older launch late writes
    nothing over newer tokens, nor into the row a finished request's successor took."""
    save_random_llama(tmp_path, "d64")
    plans = [
        step_plan(1, new=[(1, [5, 6, 7], 0), (2, [8, 9, 10, 11], 1), (3, [12, 13], 2)]),
        step_plan(2, cached=[(1, 3)]),
        step_plan(3, cached=[(1, 4), (2, 4), (3, 2)]),
        step_plan(4, new=[(4, [14, 15, 16], 2)], cached=[(1, 5), (2, 5)], finished=[3]),
        step_plan(5, cached=[(4, 3), (1, 6), (2, 6)]),
    ]

    def runner():
        return Worker(ExecutorConfig(model=str(tmp_path), device="cpu", num_kv_blocks=8)).runner

    sync = runner()
    want = [dict(zip(*sync.execute(plan), strict=True)) for plan in plans]
    ahead = runner()
    launched = [ahead.launch(plan) for plan in plans[:4]]
    got = [{} for _ in plans]
    for i in (0, 1, 3, 2):  # step 3's tokens read last: step 4 has newer ones for 1 and 2
        got[i] = dict(zip(*ahead.finish(launched[i]), strict=True))
    got[4] = dict(zip(*ahead.finish(ahead.launch(plans[4])), strict=True))
    assert got == want
    assert [sorted(step) for step in want] == [[1, 2, 3], [1], [1, 2, 3], [1, 2, 4], [1, 2, 4]]
