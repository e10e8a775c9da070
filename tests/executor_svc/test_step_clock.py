"""The executor's host phases and CUDA device time (the CUDA test skips without a GPU)."""

import time

import pytest
import torch

from pagedserve.executor.step_clock import HOST_PHASES, DeviceClock, PhaseClock, take
from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.metrics import EXECUTOR_PHASES
from tests.executor_svc.test_model_gpu import save_random_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_nested_phase_pauses_the_one_around_it_and_take_zeroes():
    clock, cpu = PhaseClock(), DeviceClock(torch.device("cpu"))
    t0 = time.perf_counter()
    with clock.phase("launch"):
        time.sleep(0.05)
        with clock.phase("bitmask"):
            time.sleep(0.1)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    t = take(clock, cpu)
    assert t.bitmask_seconds >= 0.1 and t.launch_seconds >= 0.1
    # each moment counted once: the launch's time leaves out the bitmask's 0.1 s
    assert t.launch_seconds + t.bitmask_seconds == pytest.approx(wall, abs=1e-3)
    assert t.device_busy_seconds == t.device_gap_seconds == 0  # nothing recorded on the CPU
    assert take(clock, cpu).launch_seconds == 0
    with clock.phase("idle"):
        time.sleep(0.01)
    clock.forget("idle")
    assert take(clock, cpu).idle_seconds == 0


def test_taken_inside_a_phase_the_phase_so_far_goes_to_the_next_take():
    clock, cpu = PhaseClock(), DeviceClock(torch.device("cpu"))
    with clock.phase("send"):
        time.sleep(0.02)
        first = take(clock, cpu)  # as the executor does, building its result
        time.sleep(0.03)
    assert first.send_seconds == 0
    assert take(clock, cpu).send_seconds >= 0.05


def test_the_phases_are_the_results_fields_and_the_metrics_labels():
    fields = {f.name.removesuffix("_seconds") for f in pb.ExecutorTime.DESCRIPTOR.fields}
    assert set(HOST_PHASES) == fields - {"device_busy", "device_gap", "cpu"}
    assert HOST_PHASES == EXECUTOR_PHASES


def _decode_plan(step: int, rid: int, computed: int, after_idle: bool) -> pb.StepPlan:
    return pb.StepPlan(step_id=step, cached_req_ids=[rid], cached_num_computed_tokens=[computed],
                       cached_num_scheduled_tokens=[1], cached_num_new_blocks=[0],
                       after_idle=after_idle)


@cuda
def test_device_gaps_are_measured_and_a_wait_for_work_is_left_out(tmp_path):
    save_random_llama(tmp_path, "d64")
    worker = Worker(ExecutorConfig(model=str(tmp_path), device="cuda", num_kv_blocks=64,
                                   max_num_seqs=4))
    worker.warm_up()
    runner, clock = worker.runner, PhaseClock()
    prompt = list(range(1, 20))
    runner.execute(pb.StepPlan(step_id=1, new_requests=[pb.NewRequest(
        req_id=7, token_ids=prompt, block_ids=[0, 1])], new_num_scheduled_tokens=[len(prompt)]))
    take(clock, runner.device_time)
    gaps = {}
    for step, after_idle in ((2, False), (3, True)):
        time.sleep(0.2)  # the device has nothing queued meanwhile
        runner.execute(_decode_plan(step, 7, len(prompt) + step - 2, after_idle))
        t = take(clock, runner.device_time)
        assert 0 < t.device_busy_seconds < 0.2
        gaps[after_idle] = t.device_gap_seconds
    assert gaps[False] >= 0.2  # the host's sleep, seen from the device
    assert gaps[True] == 0  # the scheduler said it had no work: not counted
