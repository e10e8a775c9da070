"""serve's restart policy: a window, not a lifetime count, and backoff within it."""

import subprocess
import sys

from pagedserve.supervise import RestartWindow, Supervised


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_restarts_are_counted_within_the_window_with_backoff():
    clock = Clock()
    w = RestartWindow(limit=5, window_s=60, backoff_s=0.5, max_backoff_s=4, clock=clock)
    assert [w.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert w.next_delay() is None  # a sixth within 60 s: give up
    clock.now = 61.0
    assert w.next_delay() == 0.5  # the window moved on


def test_six_crashes_spread_over_five_minutes_are_all_restarted():
    clock = Clock()
    w = RestartWindow(clock=clock)
    delays = []
    for minute in range(6):
        clock.now = minute * 50.0
        delays.append(w.next_delay())
    assert None not in delays


def test_a_process_that_keeps_failing_at_start_is_reported_once_then_given_up(caplog):
    fail = [sys.executable, "-c", "raise SystemExit(3)"]
    sup = Supervised("executor", lambda: subprocess.Popen(fail),
                     RestartWindow(limit=3, window_s=60, backoff_s=0.01))
    results = []
    while not results or results[-1]:
        sup.proc.wait()
        results.append(sup.check())
    assert results == [True, True, True, False]
    text = caplog.text
    assert text.count("exits during start-up each time (code 3)") == 1
    assert "exited with 3, 4 times within 60 s; giving up" in text
