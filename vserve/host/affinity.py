"""Thread placement primitives of the host OS (Linux: `sched_setaffinity`, `/proc`; elsewhere
no-ops): which CPUs this process may use, pinning every thread of a process, the CPU time
a process has used, and host work that does not preempt a forward."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available_cpus() -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def process_cpus(pid: int) -> tuple[int, ...]:
    """The CPUs `pid`'s main thread may use (() if unknown)."""
    try:
        return tuple(sorted(os.sched_getaffinity(pid)))
    except (OSError, AttributeError):
        return ()


def pin_process(pid: int, cpus: Iterable[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads started later inherit their creator's)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = set(cpus)
    for tid in _thread_ids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # thread gone, or not ours to move
            pass


def yield_on_wakeup(pid: int) -> None:
    """Every thread of `pid` (and the threads and processes they start from now on) under
    SCHED_BATCH: the same CPU share as before, but a thread that wakes up no longer preempts
    the one running on its core; it takes a core that frees or its turn at the next tick.
    Any user may choose it (a no-op off Linux)."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    for tid in _thread_ids(pid):
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError:  # thread gone, or not ours
            pass


def _thread_ids(pid: int) -> list[int]:
    """The threads of `pid` now (just `pid` where /proc cannot say)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of `pid` so far (0 if it is gone)."""
    if pid == os.getpid():
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
