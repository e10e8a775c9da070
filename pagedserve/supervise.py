"""How `pagedserve serve` keeps its two processes up: restarts within a window, with backoff,
as process supervisors do (systemd's StartLimitBurst/IntervalSec, Kubernetes' CrashLoopBackOff)."""

from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable

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
    """One child process of serve, restarted within its RestartWindow."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen],
                 window: RestartWindow | None = None, startup_s: float = 30.0) -> None:
        self.name, self._start, self.window = name, start, window or RestartWindow()
        self.startup_s = startup_s  # an exit sooner than this after a start is a failed start
        self.proc = start()
        self.started_at = time.monotonic()
        self._failed_starts: list[int] = []  # exit codes of consecutive failed starts

    def check(self) -> bool:
        """Restart the process if it exited; False when the window's restarts are spent."""
        code = self.proc.poll()
        if code is None:
            return True
        if time.monotonic() - self.started_at < self.startup_s:
            self._failed_starts.append(code)
            if self._failed_starts[-2:] == [code, code] and len(self._failed_starts) == 2:
                log.error("%s exits during start-up each time (code %s): see its log above; "
                          "restarting within the window, then giving up", self.name, code)
        else:
            self._failed_starts.clear()
        delay = self.window.next_delay()
        if delay is None:
            log.error("%s exited with %s, %d times within %g s; giving up", self.name, code,
                      self.window.limit + 1, self.window.window_s)
            return False
        log.warning("%s exited with %s; restarting in %.1f s", self.name, code, delay)
        time.sleep(delay)
        self.proc = self._start()
        self.started_at = time.monotonic()
        return True
