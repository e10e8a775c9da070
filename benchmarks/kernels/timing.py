"""What the kernel benchmarks share: the CPU smoke run's setup (called before torch and triton
are imported) and the median timer of a GPU run."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable


def interpret(scratch_prefix: str | None = None) -> None:
    """Run the Triton kernels under the CPU interpreter; with scratch_prefix, the records go
    to a scratch folder (the smoke run checks the script, not the numbers)."""
    os.environ["TRITON_INTERPRET"] = "1"
    from pagedserve.kernels._interpreter import fix_interpreter_index

    fix_interpreter_index()
    if scratch_prefix is not None:
        os.environ.setdefault("PAGEDSERVE_RESULTS", tempfile.mkdtemp(prefix=scratch_prefix))


def median_ms(fn: Callable[[], object], graph: bool, smoke: bool) -> float:
    """Median ms: do_bench (it clears L2 before each run), or CUDA-graph replays (graph: as
    the executor runs decode steps, without the launches' host time); one plain call timed on
    the host in a smoke run."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
