"""serve's restart policy: a window, not a lifetime count, and backoff within it."""

import os
import subprocess
import sys

from pagedserve.core.readiness import EXIT_CONFIG, READY_ENV
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


def run_until_given_up(sup: Supervised) -> list[bool]:
    results = []
    while not results or results[-1]:
        sup.proc.wait()
        results.append(sup.check())
    return results


def test_a_process_that_fails_twice_the_same_way_at_start_is_not_restarted_again(caplog, capfd):
    fail = [sys.executable, "-c", "import sys; print('boom: cannot start', file=sys.stderr); "
            "raise SystemExit(3)"]
    starts = []
    sup = Supervised("executor", lambda: starts.append(1) or subprocess.Popen(
        fail, stderr=subprocess.PIPE), RestartWindow(limit=5, window_s=60, backoff_s=0.01))
    assert run_until_given_up(sup) == [True, False]
    assert len(starts) == 2
    assert ("executor failed twice the same way during start-up (exit code 3); not restarting "
            "it: boom: cannot start") in caplog.text
    assert capfd.readouterr().err.count("boom: cannot start\n") == 2  # passed on, both times


def test_failures_that_differ_are_restarted_within_the_window(tmp_path, caplog):
    """A different last line each time (an attempt number) is not a repeated crash."""
    counter = tmp_path / "n"
    counter.write_text("0")
    fail = [sys.executable, "-c", f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); "
            "n = int(p.read_text()) + 1; p.write_text(str(n)); "
            "print(f'attempt {n}', file=sys.stderr); raise SystemExit(3)"]
    sup = Supervised("executor", lambda: subprocess.Popen(fail, stderr=subprocess.PIPE),
                     RestartWindow(limit=3, window_s=60, backoff_s=0.01))
    assert run_until_given_up(sup) == [True, True, True, False]
    assert counter.read_text() == "4"
    assert "exited with 3, 4 times within 60 s; giving up" in caplog.text


def test_an_exit_for_settings_that_cannot_work_is_never_restarted(caplog):
    fail = [sys.executable, "-c", "import sys; print('pagedserve executor: --kv-cache-gib 1e-09 "
            f"holds no KV block', file=sys.stderr); raise SystemExit({EXIT_CONFIG})"]
    starts = []
    sup = Supervised("executor", lambda: starts.append(1) or subprocess.Popen(
        fail, stderr=subprocess.PIPE))
    assert run_until_given_up(sup) == [False]
    assert len(starts) == 1
    assert ("executor cannot run with these settings; not restarting it: pagedserve executor: "
            "--kv-cache-gib 1e-09 holds no KV block") in caplog.text


def test_a_process_that_started_and_then_crashed_is_restarted_each_time(tmp_path):
    """Past its ready mark a crash is not a start-up failure, however alike the crashes."""
    ready = tmp_path / "ready"
    crash = [sys.executable, "-c", "import os, pathlib; pathlib.Path(os.environ[" \
             f"{READY_ENV!r}]).touch(); raise SystemExit(3)"]
    starts = []
    sup = Supervised("executor", lambda: starts.append(1) or subprocess.Popen(
        crash, env={**os.environ, READY_ENV: str(ready)}), RestartWindow(
        limit=3, window_s=60, backoff_s=0.01), ready_file=ready)
    assert run_until_given_up(sup) == [True, True, True, False]
    assert len(starts) == 4
