"""tests/integration/service.py's free ports: two test processes at once (scripts/test.sh runs
two) never hand out the same port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRAW = ("import sys; sys.path.insert(0, sys.argv[1]); "
        "from tests.integration.service import free_port; "
        "print(' '.join(str(free_port()) for _ in range(300)))")


def test_two_processes_never_hand_out_the_same_port():
    procs = [subprocess.Popen([sys.executable, "-c", DRAW, str(ROOT)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    drawn = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [len(d) for d in drawn] == [300, 300]
    assert not drawn[0] & drawn[1]
