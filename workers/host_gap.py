"""The gap between two forwards of a CPU worker whose threads share their cores with the host
work (engine core, front end): its other OpenMP threads sleep through it.

Under async scheduling the next step is already waiting when a forward ends, and the engine
core wakes on the reply to update its requests and schedule the step after it. In the gap
the worker's main thread alone replies, takes the next step and prepares its inputs, while
libgomp keeps the rest of the team spinning (300k iterations, longer than a decode step), so
the engine core finds no free core and takes one from the next forward, whose whole team
then waits for the preempted thread. Measured on two cores (paired runs, all engines alive in
one process): the forward took 0.5-1.0 ms longer under async than under sync at batch 1
(embedded model) and batch 32 (tiny model, 262k vocabulary). Parked (`cpu_ops.parked`), the
gap leaves a core to the engine core, and the forward runs on both again.

A parked thread takes a while to wake (0.3 ms measured on a 2-core VM, whose idle vCPU must
be woken first), and the forward cannot start without it. So the team wakes (`wake`) when the
gap's own host work begins, the step's input preparation: by then the engine core has had the
reply that the gap began with, and the wake-up runs under the preparation instead of after
it (batch 1 on the embedded model, 2 cores: the gap between forwards 0.84-1.01 -> 0.56-0.62
ms).

Only when it pays: the next request is already there (a wait for it, as in sync scheduling,
would park the team for the whole host step and wake it cold: measured 0.7x), the worker's
team has more than one thread, and it is not pinned apart from the host work (a reserved core,
`vserve.host.placement`, already keeps them apart). VSERVE_CPU_PARK=0 turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from vserve import cpu_ops

T = TypeVar("T")


def should_park(enabled: bool, threads: int, pinned: bool, next_ready: bool) -> bool:
    return enabled and threads > 1 and not pinned and next_ready


class HostGap:
    def __init__(self, device: str, enabled: bool) -> None:
        """enabled: VSERVE_CPU_PARK, and a single rank (workers/worker_proc.py)."""
        self.enabled = enabled and device == "cpu"
        self.pinned = False  # the placement keeps this worker's threads on their own cores

    def run(self, work: Callable[[bool], T], next_ready: bool) -> T:
        """work(parked), parked when it pays."""
        if should_park(self.enabled, torch.get_num_threads(), self.pinned, next_ready):
            parked = self._parked()
            if parked is not None:
                return parked(lambda: work(True))
        return work(False)

    def wake(self) -> None:
        """From inside the parked work: the team wakes now (cpu_ops.unpark)."""
        module = cpu_ops.load()
        if module is not None:
            module.unpark()

    def _parked(self) -> Callable | None:
        """cpu_ops.parked, loaded on first use (by then the model's kernels are built)."""
        module = cpu_ops.load()
        return None if module is None else module.parked
