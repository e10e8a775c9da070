"""Kernel time of GEMM calls without Python launch overhead (the GEMM benchmarks' timer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graph_ms(calls: Sequence[Callable[[], object]], replays: int = 15) -> float:
    """Median ms per call of one CUDA graph that runs every call once (each call on its own
    weight copy, so that none is read from L2). CUDA only."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, autotunes) outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[len(times) // 2]
