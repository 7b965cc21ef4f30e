"""`vserve.host.proc_tree`: children and descendants of a real process tree, zombies not running,
gone processes childless with an empty command line."""

import os
import signal
import subprocess
import sys
import time

import pytest

from vserve.host import proc_tree

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

# a parent that starts one sleeping child and prints its pid
PARENT = (
    "import subprocess, sys, time; "
    "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print(kid.pid, flush=True); time.sleep(60)"
)


def test_children_descendants_and_running_state():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        kid = int(parent.stdout.readline())
        assert parent.pid in proc_tree.children(os.getpid())
        assert proc_tree.children(parent.pid) == [kid]
        assert proc_tree.descendants(parent.pid) == [kid]
        mine = proc_tree.descendants(os.getpid())
        assert mine.index(parent.pid) < mine.index(kid)  # nearest first
        assert proc_tree.descendants(kid) == []
        assert b"time.sleep(60)" in proc_tree.cmdline(kid)
        assert proc_tree.is_running(parent.pid) and proc_tree.is_running(kid)
        os.kill(parent.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc_tree.is_running(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not proc_tree.is_running(parent.pid)  # a zombie until we reap it
        assert kid not in proc_tree.children(parent.pid)  # re-parented
    finally:
        parent.kill()
        parent.wait()
        try:
            os.kill(kid, signal.SIGKILL)
        except (ProcessLookupError, NameError):
            pass
    assert not proc_tree.is_running(parent.pid)
    assert proc_tree.children(parent.pid) == [] and proc_tree.cmdline(parent.pid) == b""
