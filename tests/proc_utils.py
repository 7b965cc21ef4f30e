"""Process-tree helpers for failure tests (Linux /proc, no extra dependency)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    result, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            result.append(child)
            todo.append(child)
    return result


def worker_pids(engine_pid: int) -> list[int]:
    """Worker processes under an engine core (not multiprocessing's resource tracker)."""
    out = []
    for pid in descendants(engine_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(pid)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
