"""Optional torch profiler over windows of executor steps (`--torch-profile-dir`).

Each window START:COUNT records steps [START, START + COUNT); then a Chrome trace
(`trace_<pid>_<START>.json`, open in Perfetto or chrome://tracing) and a table of the most
expensive ops (`ops_<pid>_<START>.txt`) are written to the directory. Pick windows holding the
kind of step you want to see: with W1, the first steps are prefill chunks and the later ones
graphed decodes, so e.g. `5:2,80:4`.

The op table ends with a timeline: the window's wall time, how much of it the device was busy
(kernels, copies, memsets: the union of their intervals), the longest device idle gaps, and the
host time spent in each executor phase (step_clock.HOST_PHASES; a phase's time here includes
the phases nested in it, as a launch holds the wait for a bitmask). A device busy for most of
the window is what the host overlap is for; idle gaps that line up with a phase name the host
work to shrink.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch

from pagedserve.executor.step_clock import HOST_PHASES

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, directory: str, windows: str = "40:4") -> None:
        self.dir = Path(directory)
        self.windows: list[tuple[int, int]] = []
        for window in windows.split(","):
            start, _, count = window.partition(":")
            try:
                w = (int(start), int(count or 1))
            except ValueError:
                w = (-1, 0)
            if w[0] < 0 or w[1] < 1 or (self.windows and w[0] < sum(self.windows[-1])):
                raise ValueError("profile windows must be START:COUNT[,START:COUNT...], "
                                 f"COUNT >= 1, in order and apart; got {windows!r}")
            self.windows.append(w)
        self.steps = 0
        self._prof: torch.profiler.profile | None = None

    @property
    def done(self) -> bool:
        return not self.windows and self._prof is None

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """Marks host work of one executor phase in the trace while a window records."""
        if self._prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)

    def step(self) -> None:
        """Call once per executor step, before running it."""
        if self._prof is not None and self.steps == sum(self.windows[0]):
            self._write(*self.windows.pop(0))
        if self.windows and self._prof is None and self.steps == self.windows[0][0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
        self.steps += 1

    def _write(self, start: int, count: int) -> None:
        prof, self._prof = self._prof, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}_{start}"
        prof.export_chrome_trace(str(self.dir / f"trace_{name}.json"))
        key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40)
        trace = json.loads((self.dir / f"trace_{name}.json").read_text())
        (self.dir / f"ops_{name}.txt").write_text(
            f"steps {start}..{start + count - 1}\n{table}\n\n{timeline(trace)}\n")
        log.info("torch profile of steps %d..%d written to %s", start, start + count - 1,
                 self.dir)


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _union_ms(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total length (ms) of the union of [start, end) intervals in µs, and the gaps between
    them as (start µs, length ms)."""
    busy, gaps, end = 0.0, [], None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append((end, (s - end) / 1e3))
            busy += (e - s) / 1e3
            end = e
        elif e > end:
            busy += (e - end) / 1e3
            end = e
    return busy, gaps


def timeline(trace: dict) -> str:
    """Text summary of a Chrome trace written by torch.profiler (see the module doc)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return "timeline: no events"
    t0 = min(e["ts"] for e in events)
    wall = (max(e["ts"] + e["dur"] for e in events) - t0) / 1e3
    lines = [f"timeline: window {wall:.2f} ms"]
    dev = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if dev:
        busy, gaps = _union_ms(dev)
        lines.append(f"  device busy {busy:.2f} ms ({busy / wall:.0%} of the window), "
                     f"{len(dev)} device events")
        for at, ms in sorted(gaps, key=lambda g: -g[1])[:5]:
            lines.append(f"  device idle {ms:.2f} ms from {(at - t0) / 1e3:.2f} ms")
    for name in HOST_PHASES:
        spans = [e["dur"] / 1e3 for e in events
                 if e.get("cat") == "user_annotation" and e.get("name") == name]
        if spans:
            lines.append(f"  host {name}: {sum(spans):.2f} ms in {len(spans)} calls "
                         f"(longest {max(spans):.2f} ms)")
    return "\n".join(lines)
