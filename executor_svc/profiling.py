"""Optional torch profiler over windows of executor steps (`--torch-profile-dir`).

Each window START:COUNT records steps [START, START + COUNT); then a Chrome trace
(`trace_<pid>_<START>.json`, open in Perfetto or chrome://tracing) and a table of the most
expensive ops (`ops_<pid>_<START>.txt`) are written to the directory. Pick windows holding the
kind of step you want to see: with W1, the first steps are prefill chunks and the later ones
graphed decodes, so e.g. `5:2,80:4`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

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
        (self.dir / f"ops_{name}.txt").write_text(
            f"steps {start}..{start + count - 1}\n{table}\n")
        log.info("torch profile of steps %d..%d written to %s", start, start + count - 1,
                 self.dir)
