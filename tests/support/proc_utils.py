"""Process helpers for failure tests, over `vserve.host.proc_tree`."""

from __future__ import annotations

import os
import time

from vserve.host.proc_tree import cmdline, descendants
from vserve.host.proc_tree import is_running as alive

__all__ = ["alive", "descendants", "kill", "wait_dead", "worker_pids"]


def worker_pids(engine_pid: int) -> list[int]:
    """Worker processes under an engine core (not multiprocessing's resource tracker)."""
    out = []
    for pid in descendants(engine_pid):
        if b"spawn_main" in cmdline(pid):
            out.append(pid)
    return out


def wait_dead(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
