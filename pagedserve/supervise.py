"""How `pagedserve serve` keeps its two processes up: restarts within a window, with backoff,
as process supervisors do (systemd's StartLimitBurst/IntervalSec, Kubernetes' CrashLoopBackOff)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pagedserve.core.readiness import EXIT_CONFIG

log = logging.getLogger("pagedserve")


class RestartWindow:
    """At most `limit` restarts in any `window_s` seconds; the n-th restart in the window waits
    backoff_s * 2**(n-1) (capped at max_backoff_s) before it starts."""

    def __init__(self, limit: int = 5, window_s: float = 60.0, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s = limit, window_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.clock = clock
        self._recent: deque[float] = deque()

    def next_delay(self) -> float | None:
        """Seconds to wait before restarting now, or None: too many restarts in the window."""
        now = self.clock()
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.limit:
            return None
        self._recent.append(now)
        return min(self.max_backoff_s, self.backoff_s * 2 ** (len(self._recent) - 1))


class Supervised:
    """One child process of serve, restarted within its RestartWindow, except when a restart
    cannot help: the child exits with EXIT_CONFIG (its settings cannot work), or it fails
    during start-up twice the same way (exit code and last line of stderr)."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen],
                 window: RestartWindow | None = None, startup_s: float = 30.0,
                 ready_file: Path | None = None) -> None:
        """start: makes the child; with stderr=PIPE its lines are passed on to ours and the
        last one is kept. ready_file: the child's READY_ENV file; without one, a child is
        started once it has lived startup_s."""
        self.name, self._start, self.window = name, start, window or RestartWindow()
        self.startup_s = startup_s
        self.ready_file = ready_file
        self._failed_start: tuple[int, str] | None = None  # the last one, if the latest exit
        self._launch()

    def _launch(self) -> None:
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        self.last_line = ""
        self.proc = self._start()
        self.started_at = time.monotonic()
        self._reader: threading.Thread | None = None
        if self.proc.stderr is not None:
            self._reader = threading.Thread(target=self._pass_on, args=(self.proc.stderr,),
                                            name=f"{self.name}-stderr", daemon=True)
            self._reader.start()

    def _pass_on(self, pipe) -> None:
        """Until the child closes its stderr: it would block on a full pipe left unread."""
        for line in pipe:
            text = line.decode(errors="replace")
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone; keep draining the child's
                pass
            if text := text.strip():
                self.last_line = text

    def started(self) -> bool:
        """Whether the child got through its start-up (model loaded, port bound)."""
        if self.ready_file is not None:
            return self.ready_file.exists()
        return time.monotonic() - self.started_at >= self.startup_s

    def check(self) -> bool:
        """Restart the process if it exited; False when it should not be restarted."""
        code = self.proc.poll()
        if code is None:
            return True
        if self._reader is not None:
            self._reader.join(timeout=2.0)  # the lines written before it exited
        last = self.last_line
        if code == EXIT_CONFIG:
            log.error("%s cannot run with these settings; not restarting it: %s", self.name,
                      last or f"exit code {code}")
            return False
        if self.started():
            self._failed_start = None
        elif self._failed_start == (code, last):
            log.error("%s failed twice the same way during start-up (exit code %s); not "
                      "restarting it: %s", self.name, code, last or "(no output)")
            return False
        else:
            self._failed_start = (code, last)
        delay = self.window.next_delay()
        if delay is None:
            log.error("%s exited with %s, %d times within %g s; giving up", self.name, code,
                      self.window.limit + 1, self.window.window_s)
            return False
        log.warning("%s exited with %s; restarting in %.1f s", self.name, code, delay)
        time.sleep(delay)
        self._launch()
        return True


