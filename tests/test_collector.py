"""pagedserve.core.collector: what a serving process has loaded leaves the collector's reach,
and comes back to it at exit."""

import os
import signal
import subprocess
import sys

import pytest


def test_freezing_moves_every_live_object_out_of_the_collector():
    code = ("import gc; from pagedserve.core.collector import freeze_long_lived; "
            "keep = [[i] for i in range(50000)]; freeze_long_lived(); "
            "print(gc.get_freeze_count() >= 50000, len(gc.get_objects()) < 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.timeout(120)
def test_an_executor_exits_without_nanobind_leak_warnings(model_dir):
    """The executor freezes what it loaded (triton's nanobind extension among it, through
    torch); frozen objects escaped the interpreter's last collections, and nanobind counted
    those in cycles as leaked at every exit ("nanobind: leaked 4 instances!", then 64 types
    and 514 functions). The real executor, stopped as serve stops it, once it is serving, on
    the Triton backend (the torch one, a CPU's default, no longer loads triton), exits 0
    and quietly."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PAGEDSERVE_SUPERVISOR_READY_FILE", None)
    # the executor as `pagedserve executor` runs it, saying at its exit (os._exit: the
    # command line skips the interpreter's teardown, pagedserve.cli.entry) what it loaded
    code = ("import os, runpy, sys; exit_now = os._exit; "
            "os._exit = lambda code: (print('triton loaded:', 'triton._C.libtriton' in "
            "sys.modules, file=sys.stderr, flush=True), exit_now(code)); "
            "sys.argv = ['pagedserve', 'executor', '--model', sys.argv[1], "
            "'--attention-backend', 'triton', "  # Triton's kernels (interpreted on a CPU)
            "'--scheduler-address', 'tcp://127.0.0.1:9']; "  # nothing answers: it waits
            "runpy.run_module('pagedserve.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code, str(model_dir)], env=env,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # "connecting" comes after its signal handlers, before freezing
        lines.append(line)
        if "pagedserve.executor: executor " in line and " connecting to " in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == 0, "".join(lines) + rest
    assert "triton loaded: True" in rest  # what leaked is there to leak
    assert "leaked" not in rest, rest
