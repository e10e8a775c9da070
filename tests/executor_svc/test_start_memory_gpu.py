"""Start-up at the largest step bounds on the real model shapes (issue 19): the executor comes
up with the 1B and 8B random-weight configs at 1024 sequences and 32,768 batched tokens, and
runs the largest steps those bounds allow within its memory budget. Skips without CUDA; the
8B needs about 40 GiB free (an H100/H200-class card)."""

import gc
from pathlib import Path

import pytest
import torch

from pagedserve.executor.worker import MARGIN, ExecutorConfig, MemoryBudgetError, Worker
from pagedserve.protos.internal.v1 import executor_pb2 as pb

MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"
SEQS, TOKENS = 1024, 32768
GiB = 1 << 30

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def clean_card():
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def largest_steps(worker: Worker) -> None:
    """A 32,768-token prefill over 1,024 rows, every one sampled with every extra (top-k,
    top-p, min-p, penalties, logprobs), then a graphed decode step of all 1,024."""
    per = TOKENS // SEQS
    blocks = -(-(per + 1) // worker.block_size)
    plan = pb.StepPlan(step_id=1)
    sampling = pb.Sampling(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05,
                           repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                           logprobs=True, top_logprobs=5)
    for i in range(SEQS):
        plan.new_requests.add(req_id=i, token_ids=[(7 * i + j) % 1000 for j in range(per)],
                              block_ids=list(range(i * blocks, (i + 1) * blocks)),
                              sampling=sampling)
        plan.new_num_scheduled_tokens.append(per)
    req_ids, tokens = worker.runner.execute(plan)
    assert len(req_ids) == SEQS and len(tokens) == SEQS
    req_ids, tokens = worker.runner.execute(pb.StepPlan(
        step_id=2, cached_req_ids=list(range(SEQS)), cached_num_computed_tokens=[per] * SEQS,
        cached_num_scheduled_tokens=[1] * SEQS, cached_num_new_blocks=[0] * SEQS))
    assert len(tokens) == SEQS and worker.runner.last_step_graphed


@cuda
@pytest.mark.parametrize("model", ["llama3.2-1b", "llama3.1-8b"])
def test_the_largest_step_bounds_start_and_run_within_the_budget(model, clean_card):
    free0, total = torch.cuda.mem_get_info()
    util = 0.9 if free0 > 0.95 * total else (total - free0) / total + 0.6 * free0 / total
    worker = Worker(ExecutorConfig(model=str(MODELS / model), load_format="random",
                                   device="cuda", max_num_seqs=SEQS, max_num_batched_tokens=TOKENS,
                                   gpu_memory_utilization=util))
    try:
        worker.warm_up()
        assert sorted(worker.graphs.graphs)[-1] == SEQS
        assert worker.graphs.capture_bytes <= worker._graph_estimate + MARGIN, (
            f"graphs took {worker.graphs.capture_bytes / GiB:.2f} GiB, the profile set aside "
            f"{worker._graph_estimate / GiB:.2f}")
        cap = worker.capacity
        assert (cap.max_num_seqs, cap.max_num_batched_tokens) == (SEQS, TOKENS)
        largest_steps(worker)
        torch.cuda.synchronize()
        used = total - torch.cuda.mem_get_info()[0]
        assert used <= util * total + MARGIN, f"{used / GiB:.2f} GiB used, {util:.3f} allowed"
    finally:  # a failed assertion's traceback would keep this worker's memory from the next
        worker.graphs = worker.runner = worker.swap = None
        del worker


@cuda
def test_bounds_the_card_cannot_hold_stop_with_one_line(clean_card):
    """Too little of the card for the 8B's weights, a 32,768-token step and a KV cache: a
    MemoryBudgetError naming the flags to lower, before anything else is allocated."""
    free0, total = torch.cuda.mem_get_info()
    util = (total - free0) / total + 16 * GiB / total  # 16 GiB: the weights (15) and little else
    with pytest.raises(MemoryBudgetError) as e:
        Worker(ExecutorConfig(model=str(MODELS / "llama3.1-8b"), load_format="random",
                              device="cuda", max_num_seqs=SEQS, max_num_batched_tokens=TOKENS,
                              gpu_memory_utilization=util))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"--max-num-seqs {SEQS} and --max-num-batched-tokens {TOKENS} need ")
    assert line.endswith("lower --max-num-seqs or --max-num-batched-tokens, or raise "
                         "--gpu-memory-utilization")
