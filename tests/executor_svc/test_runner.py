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
