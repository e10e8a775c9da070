import json

import pytest
import torch

from executor_svc.profiling import StepProfiler


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
