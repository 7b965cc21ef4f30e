"""Processes that end with their parent: the engine core with its front end, a worker with
its engine core (or `vserve worker`).

A daemon thread polls the parent pid; it needs no cooperation from the process's other
threads, so a busy or stuck main loop, or a dead input thread, cannot keep an orphan alive.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable

POLL_S = 0.5


def exit_with_parent(
    parent_pid: int, on_parent_gone: Callable[[], None] | None = None, grace_s: float = 0.0
) -> threading.Thread:
    """When `parent_pid` is no longer our parent: call `on_parent_gone` (a polite shutdown),
    give it `grace_s` seconds to end the process, then kill our children and exit(1)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        if on_parent_gone is not None:
            try:
                on_parent_gone()
            except Exception:  # noqa: BLE001 -- we are leaving either way
                pass
            time.sleep(grace_s)
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(1)

    thread = threading.Thread(target=watch, daemon=True, name="vserve-lifeline")
    thread.start()
    return thread
