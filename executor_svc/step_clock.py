"""Where the executor's time goes, always on and cheap enough for every step: host seconds by
phase, and on CUDA the device's busy time and the gaps between launches, from events on the
stream. Each result carries what was added since the previous one (pb.ExecutorTime), and the
scheduler exports the sums: a host-bound deployment shows as device gaps beside the host phase
that fills them, in Grafana as in a benchmark record.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator

import torch

from pagedserve.protos.internal.v1 import executor_pb2 as pb

HOST_PHASES = ("idle", "wait", "recv", "launch", "bitmask", "finish", "send")


class PhaseClock:
    """Host seconds by phase. Phases nest: an inner one (awaiting a bitmask inside a launch)
    pauses the one around it, so the phases add up to the wall time they cover."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(HOST_PHASES, 0.0)
        self._stack: list[str] = []
        self._since = 0.0
        self.cpu_at = time.process_time()  # the process's CPU time at the last take()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._stack:
            self.totals[self._stack[-1]] += now - self._since
        self._stack.append(name)
        self._since = now
        try:
            yield
        finally:
            now = time.perf_counter()
            self.totals[self._stack.pop()] += now - self._since
            self._since = now

    def forget(self, name: str) -> None:
        """Drop what `name` holds (the idle wait before a plan that followed the scheduler's own
        idleness: no work, not overhead)."""
        self.totals[name] = 0.0


class DeviceClock:
    """CUDA: timing events on the current stream around each launch's device work, from just
    before its forward pass's first input copy to the copy of its tokens (a wait for token
    bitmasks between the forward pass and sampling splits it in two). Busy is the time inside
    spans; gap is one span's end to the next one's start, when the device had nothing queued
    (a launch's host work before its first copy shows there). Events are read once they have
    completed, so a launch answered without waiting (a prefill chunk that samples nothing) is
    counted in a later result. On the CPU nothing is recorded; after a CUDA error the clock
    stops rather than fail a step."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self._spans: deque[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = deque()
        self._open: tuple[torch.cuda.Event, bool] | None = None
        self._last_end: torch.cuda.Event | None = None
        self.busy = self.gap = 0.0

    def begin(self, after_idle: bool = False) -> None:
        """Open a span; after_idle: the gap before it is no work (StepPlan.after_idle)."""
        if self.on and self._open is None:
            with self._guard():
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._open = (start, after_idle)

    def close(self, end: torch.cuda.Event | None = None) -> None:
        """Close the open span, if any, at `end` (a timing event already recorded after its
        work) or here."""
        if self._open is None:
            return
        (start, after_idle), self._open = self._open, None
        with self._guard():
            if end is None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            self._spans.append((start, end, after_idle))

    def read(self) -> None:
        """Add the completed spans, oldest first, to busy and gap."""
        with self._guard():
            while self._spans and self._spans[0][1].query():
                start, end, after_idle = self._spans.popleft()
                self.busy += start.elapsed_time(end) / 1e3
                if self._last_end is not None and not after_idle:
                    self.gap += self._last_end.elapsed_time(start) / 1e3
                self._last_end = end

    def reset(self) -> None:
        """A new scheduler session: nothing before it is reported or followed."""
        self._spans.clear()
        self._open = self._last_end = None
        self.busy = self.gap = 0.0

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError:  # a CUDA error: the step reports it; timing is not worth more
            self.on = False
            self.reset()


def take(clock: PhaseClock, device: DeviceClock) -> pb.ExecutorTime:
    """What both clocks added since the last take, as a result's ExecutorTime; zeroes them."""
    device.read()
    out = pb.ExecutorTime(**{f"{p}_seconds": s for p, s in clock.totals.items()},
                          device_busy_seconds=device.busy, device_gap_seconds=device.gap)
    cpu = time.process_time()
    out.cpu_seconds, clock.cpu_at = cpu - clock.cpu_at, cpu
    clock.totals = dict.fromkeys(HOST_PHASES, 0.0)
    device.busy = device.gap = 0.0
    return out
