"""Cheap per-step timestamps for the overlap report and the trace.

The engine core records, for every step: schedule start and end, launch (when it was handed
to the executor) and commit start and end; the worker adds its receive, forward start and end,
and result-ready times (its own clock; on one host `perf_counter` is shared by processes).

Both stores are rings: a long-running server keeps recording (and its step metrics keep
updating) after `max_records` steps, holding only the newest records. A server never takes its
records (only a benchmark does), so the ring is what it holds: 16384 slotted records, a few
MB; an overlap report covers at most the newest 16384 steps.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

MAX_RECORDS = 16384  # (a soak at 540 steps a minute held 100k-record rings: +15 MiB in 30 min)


@dataclass(slots=True)
class StepRecord:
    step_id: int
    num_tokens: int
    num_reqs: int
    queue_len: int  # steps already in flight when this one was scheduled
    schedule_start: float
    schedule_end: float
    commit_start: float = 0.0
    commit_end: float = 0.0
    recv: float = 0.0
    forward_start: float = 0.0
    forward_end: float = 0.0
    ready: float = 0.0
    # (start, end) of each PP stage's own forward, first to last; empty: one stage, whose
    # forward is forward_start..forward_end
    stage_forwards: tuple[tuple[float, float], ...] = ()
    launch_interval: float = 0.0  # since the previous launch (0 for the first after idle)
    parked: bool = False  # inputs made in the gap before, the worker's other threads asleep
    device_forward: float = 0.0  # CUDA: the forward and sampling on the device (events)
    compiles: int = 0  # Triton compiles in the worker during the step
    no_overlap: str | None = None  # why the device waited for the host: no other step with
    #                                tokens in flight at launch, or its sampling waited for older
    #                                steps (a grammar)


class StepRecorder:
    def __init__(self, enabled: bool = True, max_records: int = MAX_RECORDS) -> None:
        self.enabled = enabled
        self.max_records = max_records
        self.records: dict[int, StepRecord] = {}  # by step id, oldest first
        # committed since the last `drain_recent`
        self.recent: deque[StepRecord] = deque(maxlen=max_records)
        self._last_launch = 0.0

    def scheduled(
        self,
        so,
        start: float,
        end: float,
        queue_len: int,
        no_overlap: str | None = None,
        after_idle: bool = False,
    ) -> None:
        if self.enabled:
            if len(self.records) >= self.max_records:  # drop the oldest
                del self.records[next(iter(self.records))]
            rec = StepRecord(
                so.step_id,
                so.total_num_scheduled_tokens,
                len(so.num_scheduled_tokens),
                queue_len,
                start,
                end,
            )
            if self._last_launch and not after_idle:
                rec.launch_interval = end - self._last_launch
            rec.no_overlap = no_overlap
            self._last_launch = end
            self.records[so.step_id] = rec

    def committed(self, so, runner_output, start: float, end: float) -> None:
        rec = self.records.get(so.step_id)
        if rec is None:
            return
        rec.commit_start, rec.commit_end = start, end
        timing = getattr(runner_output, "timing", None)
        if timing is not None:
            rec.recv, rec.forward_start = timing.recv, timing.forward_start
            rec.stage_forwards = tuple(timing.stage_forwards)
            rec.forward_end, rec.ready = timing.forward_end, timing.ready
            rec.parked = timing.parked
            rec.device_forward = timing.device_forward
            rec.compiles = timing.compiles
        self.recent.append(rec)

    def drain_recent(self) -> list[StepRecord]:
        recent = list(self.recent)
        self.recent.clear()
        return recent

    def take(self) -> list[StepRecord]:
        records = sorted(self.records.values(), key=lambda r: r.step_id)
        self.records = {}
        return records


Span = tuple[float, float]


class Coverage:
    """The union of a set of spans, asked how much of an interval it covers."""

    def __init__(self, spans: list[Span]) -> None:
        merged: list[list[float]] = []
        for start, end in sorted(s for s in spans if s[1] > s[0]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.spans = merged
        self.starts = [s for s, _ in merged]

    def covered(self, start: float, end: float) -> float:
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        total = 0.0
        while i < len(self.spans) and self.spans[i][0] < end:
            lo, hi = max(start, self.spans[i][0]), min(end, self.spans[i][1])
            total += max(0.0, hi - lo)
            i += 1
        return total

    def exposed(self, start: float, end: float) -> float:
        """Length of [start, end] outside the union: spans that overlap (PP stages run steps
        side by side) count once."""
        return max(0.0, (end - start) - self.covered(start, end))
