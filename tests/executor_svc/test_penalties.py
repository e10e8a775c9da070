"""TokenCounts (executor_svc/penalties.py): the per-request token counts of the penalties."""

import torch

from pagedserve.executor.penalties import TokenCounts


def test_counts_grown_in_inference_mode_take_updates_outside_it():
    """The GPU memory profile acquires every slot inside inference mode; serving then records
    tokens outside it (an inference tensor would refuse the in-place update)."""
    counts = TokenCounts(16, torch.device("cpu"))
    with torch.inference_mode():
        slots = [counts.acquire() for _ in range(3)]
    counts.reset()
    counts.load([(slots[0], [1, 2, 2], 1)])
    counts.record(torch.tensor([slots[0]]), torch.tensor([5]))
    assert counts.output[slots[0]].tolist() == [0, 0, 2, 0, 0, 1] + [0] * 10
