"""Logs every Triton kernel compiled after the executor is ready.

A kernel variant compiled while serving stalls the step that needs it (0.1-1 s on an H200), and
so every request in that step. Variants come from constexprs and from Triton's specialisation of
int arguments (value 1, divisible by 16, other), so a per-step int that is not marked
`do_not_specialize` compiles a new variant the first time its divisibility changes. Warm-up and
CUDA-graph capture compile what the executor can foresee; a warning from here names the kernel
and its specialisation, which is what to add to warm-up or to `do_not_specialize`.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("pagedserve.executor")


class JitWatch:
    def __init__(self) -> None:
        self.compiles = 0
        self._started: float | None = None

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:  # no Triton (CPU-only install): nothing compiles
            return False
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        return True

    def _before(self, **_: object) -> bool:
        self._started = time.perf_counter()
        return False  # compile it

    def _after(self, *, repr: str, **_: object) -> bool:  # noqa: A002 (Triton's keyword)
        took = time.perf_counter() - self._started if self._started is not None else 0.0
        self._started = None
        self.compiles += 1
        log.warning("Triton compiled a kernel variant mid-serving in %.2f s (the step waited): %s",
                    took, repr)
        return False
