"""pagedserve.core.collector: what a serving process has loaded leaves the collector's reach."""

import subprocess
import sys


def test_freezing_moves_every_live_object_out_of_the_collector():
    code = ("import gc; from pagedserve.core.collector import freeze_long_lived; "
            "keep = [[i] for i in range(50000)]; freeze_long_lived(); "
            "print(gc.get_freeze_count() >= 50000, len(gc.get_objects()) < 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"]
