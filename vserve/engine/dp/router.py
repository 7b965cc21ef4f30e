"""Which data-parallel engine takes a request: the live one with the lowest
`4 x waiting + running`, as vLLM's load balancer scores engines.

The figures come from the engines: every step's output carries its scheduler's counts, and
the router takes an engine's latest ones at most every `refresh_s` (100 ms). In between it
counts its own assignments optimistically as waiting requests, so a burst of requests that
arrives between two figures spreads over the engines instead of piling onto the one that
looked idle. Ties go to the lowest rank. No I/O here: the clients feed it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

REFRESH_S = 0.1
WAITING_WEIGHT = 4


@dataclass
class _Load:
    waiting: int = 0  # the last figure taken, plus our assignments since
    running: int = 0
    taken_at: float = -1e9  # when the figure was taken (router clock)
    latest: tuple[int, int] | None = None  # the newest figure received, not yet taken

    @property
    def score(self) -> int:
        return WAITING_WEIGHT * self.waiting + self.running


class LoadRouter:
    def __init__(
        self,
        ranks: list[int],
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loads = {rank: _Load() for rank in ranks}
        self.alive = set(ranks)
        self.refresh_s = refresh_s
        self.clock = clock
        self.num_assigned = dict.fromkeys(ranks, 0)  # requests sent to each engine, in all

    def publish(self, rank: int, waiting: int, running: int) -> None:
        """A figure an engine sent (taken at the next choice, at most every `refresh_s`)."""
        self.loads[rank].latest = (waiting, running)

    def choose(self, pinned: int | None = None) -> int:
        """The engine for the next request, counted as one more waiting there."""
        if pinned is not None:
            if pinned not in self.loads:
                raise ValueError(
                    f"data_parallel_rank {pinned} is not one of the ranks {sorted(self.loads)}"
                )
            if pinned not in self.alive:
                raise ValueError(f"data-parallel engine {pinned} is dead")
            rank = pinned
        else:
            if not self.alive:
                raise ValueError("no data-parallel engine is alive")
            now = self.clock()
            for r in self.alive:
                self._refresh(self.loads[r], now)
            rank = min(sorted(self.alive), key=lambda r: self.loads[r].score)
        self.loads[rank].waiting += 1
        self.num_assigned[rank] += 1
        return rank

    def _refresh(self, load: _Load, now: float) -> None:
        if load.latest is not None and now - load.taken_at >= self.refresh_s:
            load.waiting, load.running = load.latest
            load.latest, load.taken_at = None, now

    def remove(self, rank: int) -> None:
        """An engine that died: it gets no more requests."""
        self.alive.discard(rank)
