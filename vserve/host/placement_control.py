"""Applying a `Placement` while the engine runs, and measuring what it is chosen from.

`PlacementController` lives in the multiprocess executor. Every reply brings the worker's
wall time for its step; every window (enough steps and enough time, the workers busy for most
of it) it reads the CPU time the host processes spent (the engine core itself when it
schedules beside the forward, and the front end) and the workers spent, asks
`choose_num_reserved`, and when the answer changes it sends the workers their
new CPUs and pins the host processes. Linux only (`os.sched_setaffinity`, `/proc`); elsewhere
nothing is pinned and the workers keep their threads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from vserve.host.affinity import available_cpus, pin_process, process_cpu_seconds, process_cpus
from vserve.host.placement import (
    Placement,
    PlacementOverrides,
    choose_num_reserved,
    parse_overrides,
    plan_placement,
)

logger = logging.getLogger("vserve.executor")

WINDOW_STEPS = 8  # at least this many steps ...
WINDOW_SECONDS = 0.15  # ... and this much wall time per decision (short: a host-bound
# run of a second must not spend a third of it unplaced)
MIN_BUSY_FRACTION = 0.5  # windows where the worker idled more than this are discarded


def overrides_from_env() -> PlacementOverrides:
    from vserve.envs import read_env

    env = read_env()
    return parse_overrides(env.cpu_num_reserved, env.cpu_threads_bind)


class PlacementController:
    """Chooses the placement from measured figures and applies it (see the module doc)."""

    def __init__(
        self,
        num_workers: int,
        overrides: PlacementOverrides,
        send_to_workers: Callable[[Placement], None],
        measure_self: bool,
        cpus: tuple[int, ...] | None = None,
        os_hooks=None,
        layer_shares: tuple[float, ...] = (),
        pin_workers: bool = False,
    ) -> None:
        """`measure_self`: this process (the engine core) works beside the forward (async
        scheduling), so its CPU time counts as host work. `os_hooks` (tests): replacements for
        (pin_process, process_cpu_seconds, process_cpus, clock)."""
        self._pin, self._cpu_seconds, self._cpus_of, self._clock = os_hooks or (
            pin_process,
            process_cpu_seconds,
            process_cpus,
            time.perf_counter,
        )
        self.cpus = cpus or available_cpus()
        self.num_workers = num_workers
        self.overrides = overrides
        self.layer_shares = layer_shares  # PP: prompt-heavy steps' threads follow these
        self.pin_workers = pin_workers  # TP: each worker on its own cores
        self.send_to_workers = send_to_workers
        self.host_pids: list[int] = [os.getpid()]  # pinned to the host CPUs
        self._original = {os.getpid(): self.cpus}  # each host process's CPUs before us
        self.measured_pids = [os.getpid()] if measure_self else []  # CPU time = host work
        self.worker_pids: list[int] = []  # set once the workers run
        self.placement = plan_placement(
            self.cpus,
            num_workers,
            overrides.num_reserved or 0,
            overrides,
            layer_shares,
            pin_workers,
        )
        self.num_changes = 0
        self._reset_window()

    @property
    def adaptive(self) -> bool:
        return not self.overrides.fixed and len(self.cpus) > self.num_workers

    def add_host_process(self, pid: int, measured: bool = True) -> None:
        """A process that does host work (the front end): pinned with the host; its CPU time
        counts as host work beside the forward when `measured`."""
        if pid not in self.host_pids:
            self.host_pids.append(pid)
            self._original[pid] = self._cpus_of(pid) or self.cpus
        if measured and pid not in self.measured_pids:
            self.measured_pids.append(pid)
            self._reset_window()
        if self.placement.pins_host:
            self._pin(pid, self.placement.host_cpus)

    def start(self) -> None:
        """Pin the host for a fixed placement (the workers got theirs when they started)."""
        if self.placement.pins_host:
            for pid in self.host_pids:
                self._pin(pid, self.placement.host_cpus)

    def step_done(self, worker_busy_s: float) -> None:
        """One step's reply: the worker spent `worker_busy_s` of wall time on it."""
        if not self.adaptive:
            return
        self._steps += 1
        self._busy += max(0.0, worker_busy_s)
        elapsed = self._clock() - self._start
        if self._steps < WINDOW_STEPS or elapsed < WINDOW_SECONDS:
            return
        if self._busy >= MIN_BUSY_FRACTION * elapsed:
            host, workers = self._cpu_times()
            self._decide(host - self._cpu0[0], workers - self._cpu0[1])
        self._reset_window()

    def _decide(self, host_cpu_s: float, worker_cpu_s: float) -> None:
        current = self.placement.num_reserved
        wanted = choose_num_reserved(
            host_cpu_s, worker_cpu_s, current, len(self.cpus), self.num_workers, self.overrides
        )
        if wanted == current:
            return
        self.apply(
            plan_placement(
                self.cpus,
                self.num_workers,
                wanted,
                self.overrides,
                self.layer_shares,
                self.pin_workers,
            )
        )
        logger.info(
            "CPU placement: %d core(s) reserved for host work (host CPU %.2f x the "
            "workers'); workers on %s with %s threads, host on %s",
            wanted,
            host_cpu_s / max(worker_cpu_s, 1e-9),
            self.placement.worker_cpus or "any CPU",
            self.placement.worker_threads,
            self.placement.host_cpus or "any CPU",
        )

    def apply(self, placement: Placement) -> None:
        self.placement = placement
        self.num_changes += 1
        self.send_to_workers(placement)
        for pid in self.host_pids:
            self._pin(pid, placement.host_cpus or self._original[pid])

    def release(self) -> None:
        """Give the host processes their CPUs back (the front end outlives the engine)."""
        if self.placement.pins_host:
            for pid in self.host_pids:
                self._pin(pid, self._original[pid])

    def _cpu_times(self) -> tuple[float, float]:
        return (
            sum(self._cpu_seconds(pid) for pid in self.measured_pids),
            sum(self._cpu_seconds(pid) for pid in self.worker_pids),
        )

    def _reset_window(self) -> None:
        self._steps, self._busy = 0, 0.0
        self._start = self._clock()
        self._cpu0 = self._cpu_times()
