"""Triton compiles made in this process, counted from Triton's own hook.

Triton calls `jit_cache_hook` each time a kernel meets a specialization it holds no compiled
variant of (compiled now, or loaded from Triton's disk cache), never for a launch of one it
holds. A warmed engine (`workers/memory_profile.py`, the decode graphs' capture) should see
none while it serves; each step reports the compiles made since the step before
(`StepTiming.compiles`), and the engine sums them (`/metrics`: `vserve:triton_compiles`, the
bench's overlap report). The step's timing comes back from the sampling worker only, so with
pipeline or tensor parallelism the count is that worker's (its kernels are the others').
Under TRITON_INTERPRET=1 nothing compiles, so nothing is counted.
"""

from __future__ import annotations

_state = {"installed": False, "count": 0, "taken": 0}


def install() -> None:
    """Chain a counting hook in front of any hook already set (idempotent)."""
    if _state["installed"]:
        return
    try:  # Triton 3.4 on
        from triton import knobs

        owner, name = knobs.runtime, "jit_cache_hook"
    except ImportError:  # earlier: a class attribute of JITFunction
        from triton.runtime.jit import JITFunction

        owner, name = JITFunction, "cache_hook"
    previous = getattr(owner, name)

    def hook(*args, **kwargs):
        _state["count"] += 1
        # a hook that returns True makes Triton skip the compile: leave that to the previous
        return previous(*args, **kwargs) if previous is not None else None

    setattr(owner, name, hook)
    _state["installed"] = True


def total() -> int:
    """Compiles since `install`."""
    return _state["count"]


def take() -> int:
    """Compiles since the last `take` (or `install`)."""
    new = _state["count"] - _state["taken"]
    _state["taken"] = _state["count"]
    return new
