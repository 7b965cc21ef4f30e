"""The C heap's policy: keep freed pages while a process works, give them back when it rests.

Workers keep large freed buffers (`keep_freed_pages`): glibc serves allocations above its mmap
threshold with fresh pages and unmaps them on free, so every step's multi-megabyte activations
and K/V gathers page-fault anew (a 3x slowdown measured on decode attention). The threshold
cannot go above 32 MiB, and a step's logits are larger (32 rows x 262k vocabulary in fp32:
33.5 MiB), so mmap is turned off altogether and the heap is never trimmed on free: on the tiny
262k-vocabulary model at batch 32 the step fell from 34 to 22 ms.

The price is a heap that only grows: the largest step so far, and the garbage of start-up
(parsing Gemma's 33 MB `tokenizer.json` leaves about 180 MB behind, converting weights more).
`trim()` calls `malloc_trim(0)`, which releases the free pages of every arena, at the moments
a process has just let a large working set go: the end of start-up, and idle (a worker with no
step for a second, a front end with no output for a second: `trim_when_idle`). Both only
act on glibc; elsewhere (musl, macOS) they do nothing.

Python's cyclic GC is the other half of start-up's garbage: its objects (modules, the model,
configs, the tokenizer) outlive every request, yet each full collection walks them all: 90-160
ms in a worker, paid inside a step (a batch-1 run of 128 tokens lost 7% to one). `startup_over`
collects once and freezes what survives (`gc.freeze`), so later collections see only objects
made after start-up. Only processes vserve owns do it (workers, the engine core, the server):
an in-process engine leaves its user's process alone.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
from collections.abc import Awaitable, Callable

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 -- glibc's, absent elsewhere
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_pages() -> None:
    """Serve every allocation from the heap and never trim it on free (a worker's steps)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)  # glibc's maximum
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(_M_MMAP_MAX, 0)  # larger blocks: the heap too


def trim() -> bool:
    """Release the heap's free pages; True when the C library returned some."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def startup_over() -> None:
    """Start-up's garbage collected, its survivors out of the GC's reach, free pages back."""
    gc.collect()
    gc.freeze()
    trim()


async def trim_when_idle(
    activity: Callable[[], int],
    idle_s: float = 1.0,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> None:
    """Trim once after each busy period: when `activity()` (a counter of work done) moved
    since the last trim and then stood still for `idle_s` (`sleep`: how it waits, asyncio's).
    Runs until cancelled."""
    last, busy = activity(), False
    while True:
        await sleep(idle_s)
        now = activity()
        if now != last:
            last, busy = now, True
        elif busy:
            trim()
            busy = False
