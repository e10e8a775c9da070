from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.engine import fit_step_bounds
from pagedserve.scheduler.scheduler import SchedulerConfig


def test_step_bounds_are_lowered_to_what_the_executor_profiled():
    cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    got = fit_step_bounds(cfg, pb.Capacity(max_num_batched_tokens=4096, max_num_seqs=512))
    assert (got.max_num_batched_tokens, got.max_num_seqs) == (4096, 256)
    assert fit_step_bounds(cfg, pb.Capacity()) == cfg  # 0: not profiled (CPU), no bound
