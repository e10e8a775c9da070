import contextlib
import json

import pytest
import torch

from pagedserve.executor.profiling import StepProfiler, timeline


def test_profiles_exactly_its_windows(tmp_path):
    prof = StepProfiler(str(tmp_path), "2:3,6:1")
    x = torch.randn(64, 64)
    for _ in range(8):
        prof.step()
        torch.mm(x, x)
    assert prof.done
    for start, calls in ((2, 3), (6, 1)):
        trace = next(tmp_path.glob(f"trace_*_{start}.json"))
        names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"]]
        assert names.count("aten::mm") == calls
    assert next(tmp_path.glob("ops_*_2.txt")).read_text().startswith("steps 2..4\n")


@pytest.mark.parametrize("windows", ["3:0", "x", "5:2,6:1", "-1:2"])
def test_bad_windows(windows):
    with pytest.raises(ValueError, match="START:COUNT"):
        StepProfiler("x", windows)


def test_timeline_unions_device_intervals_and_sums_phases():
    ev = [  # µs; device busy [0, 300) and [1300, 1500): 500 µs of a 2 ms window
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 200},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 100, "dur": 200},
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 1300, "dur": 200},
        {"ph": "X", "cat": "user_annotation", "name": "launch", "ts": 500, "dur": 600},
        {"ph": "X", "cat": "user_annotation", "name": "launch", "ts": 1600, "dur": 400},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1700, "dur": 100},
    ]
    text = timeline({"traceEvents": ev})
    assert text.splitlines() == [
        "timeline: window 2.00 ms",
        "  device busy 0.50 ms (25% of the window), 3 device events",
        "  device idle 1.00 ms from 0.30 ms",
        "  host launch: 1.00 ms in 2 calls (longest 0.60 ms)",
    ]


def test_phases_are_marked_only_inside_a_window(tmp_path):
    prof = StepProfiler(str(tmp_path), "1:1")
    assert isinstance(prof.phase("launch"), contextlib.nullcontext)
    for _ in range(3):
        prof.step()
        with prof.phase("launch"):
            torch.ones(4).sum()
    ops = next(tmp_path.glob("ops_*_1.txt")).read_text()
    assert "  host launch: " in ops and " in 1 calls " in ops
