"""kernels/prefetch.py: weights asked into the L2 on a side stream. A hint that changes no
value: on Hopper it runs on every size without a fault, inside CUDA-graph capture too; where it
cannot run (CPU, older GPUs, tensors it cannot address in 16-byte units) it forks nothing."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import prefetch

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (bulk L2 prefetch)")


def test_where_it_cannot_run_it_forks_nothing():
    w = torch.randn(64, 64)
    assert not prefetch.supported(w)
    assert prefetch.start(w) is None
    prefetch.join(None)
    if torch.cuda.is_available():  # too small for one 16-byte unit, or not contiguous
        assert not prefetch.supported(torch.ones(3, device="cuda", dtype=torch.bfloat16))
        assert not prefetch.supported(torch.ones(64, 64, device="cuda").t()[:5])


@needs_hopper
@pytest.mark.parametrize("numel", [8, 2048 + 8, 3 * 2**20 + 24, 40 * 2**20 + 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_size_prefetches_without_a_fault_and_changes_nothing(numel, dtype):
    """Sizes not a multiple of the 4 KiB chunk nor of 16 bytes (the tail rounds down), one
    program's 256 KiB and beyond, a weight larger than the L2."""
    w = torch.randn(numel, device="cuda").to(dtype)
    before = w.clone()
    side = prefetch.start(w)
    assert side is not None
    prefetch.join(side)
    torch.cuda.synchronize()
    assert torch.equal(w, before)


@needs_hopper
def test_a_graph_captures_the_fork_and_replays_the_eager_result():
    """start / join inside capture: the side stream joins the graph, the read after the join
    equals the eager one at every replay, with new inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2048, 4096, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        side = prefetch.start(w)
        y = torch.relu(x)  # the work the prefetch runs beside
        prefetch.join(side)
        out.copy_(torch.nn.functional.linear(y, w))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, device="cuda", generator=g).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.nn.functional.linear(torch.relu(x), w))
