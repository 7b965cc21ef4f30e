"""The overlap report: how much of the host's work the device hides, from per-step records.

For every step the engine core records schedule start/end, launch and commit; the worker adds
its forward start/end (one monotonic clock per host). From these:

* mean model forward time and mean step launch interval (launch to next launch);
* overlap efficiency = forward / interval (1.0: the device never waits for the host);
* scheduler time hidden under a forward vs exposed (no forward running meanwhile);
* TPOT p50 / p99 from the requests' token timestamps;
* steps launched while no other step was in flight, by the reason the engine gave.

`chrome_trace` turns the same records into a Chrome trace (chrome://tracing, Perfetto): one CPU
lane per process (front end: detokenize; engine core: schedule, update) and a device lane per
worker (forward), so the report's figures can be checked against the timeline.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from vserve.engine.recorder import StepRecord, exposed_time


@dataclass
class OverlapReport:
    num_steps: int
    mean_forward_ms: float
    mean_launch_interval_ms: float
    overlap_efficiency: float
    schedule_total_ms: float
    schedule_hidden_ms: float
    schedule_exposed_ms: float
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    steps_without_overlap: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [
            "{s:{c}^60}".format(s=" Overlap report ", c="="),
            f"{'Steps (with tokens):':<44}{self.num_steps:>14}",
            f"{'Mean model forward time (ms):':<44}{self.mean_forward_ms:>14.2f}",
            f"{'Mean step launch interval (ms):':<44}{self.mean_launch_interval_ms:>14.2f}",
            f"{'Overlap efficiency (forward / interval):':<44}{self.overlap_efficiency:>14.3f}",
            f"{'Scheduler time total (ms):':<44}{self.schedule_total_ms:>14.2f}",
            f"{'  hidden under a forward (ms):':<44}{self.schedule_hidden_ms:>14.2f}",
            f"{'  exposed (ms):':<44}{self.schedule_exposed_ms:>14.2f}",
            f"{'TPOT p50 (ms):':<44}{_fmt(self.tpot_p50_ms):>14}",
            f"{'TPOT p99 (ms):':<44}{_fmt(self.tpot_p99_ms):>14}",
            f"{'Steps without overlap:':<44}{sum(self.steps_without_overlap.values()):>14}",
        ]
        for reason, count in sorted(self.steps_without_overlap.items()):
            lines.append(f"  {reason:<56}{count:>6}")
        lines.append("=" * 60)
        return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def busy_steps(records: list[StepRecord]) -> list[StepRecord]:
    return [r for r in records if r.num_tokens > 0 and r.forward_end > 0]


def overlap_report(records: list[StepRecord], request_outputs=()) -> OverlapReport:
    steps = busy_steps(records)
    forwards = [r.forward_end - r.forward_start for r in steps]
    intervals = [r.launch_interval for r in steps if r.launch_interval > 0]
    spans = [(r.forward_start, r.forward_end) for r in steps]
    sched_total = sum(r.schedule_end - r.schedule_start for r in steps)
    exposed = sum(exposed_time(r.schedule_start, r.schedule_end, spans) for r in steps)
    mean_fwd = statistics.fmean(forwards) if forwards else 0.0
    mean_int = statistics.fmean(intervals) if intervals else 0.0
    tpots = request_tpots(request_outputs)
    reasons: dict[str, int] = {}
    for r in steps:
        if r.no_overlap:
            reasons[r.no_overlap] = reasons.get(r.no_overlap, 0) + 1
    return OverlapReport(
        num_steps=len(steps), mean_forward_ms=mean_fwd * 1e3,
        mean_launch_interval_ms=mean_int * 1e3,
        overlap_efficiency=(mean_fwd / mean_int) if mean_int else 0.0,
        schedule_total_ms=sched_total * 1e3, schedule_hidden_ms=(sched_total - exposed) * 1e3,
        schedule_exposed_ms=exposed * 1e3,
        tpot_p50_ms=percentile(tpots, 50), tpot_p99_ms=percentile(tpots, 99),
        steps_without_overlap=reasons)


def request_tpots(request_outputs) -> list[float]:
    """Per request: (last token time - first token time) / (output tokens - 1), in ms."""
    out = []
    for ro in request_outputs:
        m = ro.metrics
        n = sum(len(c.token_ids) for c in ro.outputs) // max(1, len(ro.outputs))
        if n > 1 and "first_token_time" in m:
            out.append((m["last_token_time"] - m["first_token_time"]) / (n - 1) * 1e3)
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# -- timeline ------------------------------------------------------------------------------------
FRONTEND_PID, ENGINE_PID, WORKER_PID = 1, 2, 3


def chrome_trace(records: list[StepRecord], detokenize_spans=()) -> dict:
    steps = busy_steps(records)
    points = [t for r in steps for t in (r.schedule_start, r.forward_start)]
    points += [s for s, _ in detokenize_spans]
    t0 = min(points) if points else 0.0
    events = _lane_names()

    def slice_(name, pid, tid, start, end, **args):
        events.append({"name": name, "ph": "X", "pid": pid, "tid": tid,
                       "ts": (start - t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
                       "args": args})

    for r in steps:
        info = dict(step=r.step_id, tokens=r.num_tokens, reqs=r.num_reqs)
        slice_("schedule", ENGINE_PID, 1, r.schedule_start, r.schedule_end, **info)
        if r.commit_end:
            slice_("update", ENGINE_PID, 2, r.commit_start, r.commit_end, **info)
        slice_("forward", WORKER_PID, 1, r.forward_start, r.forward_end, **info)
    for start, end in detokenize_spans:
        slice_("detokenize", FRONTEND_PID, 1, start, end)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _lane_names() -> list[dict]:
    meta = []
    for pid, name in ((FRONTEND_PID, "front end (CPU)"), (ENGINE_PID, "engine core (CPU)"),
                      (WORKER_PID, "worker (device)")):
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    for pid, tid, name in ((FRONTEND_PID, 1, "detokenize"), (ENGINE_PID, 1, "schedule"),
                           (ENGINE_PID, 2, "update"), (WORKER_PID, 1, "forward")):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": name}})
    return meta


def write_trace(path: str, records, detokenize_spans=()) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(records, detokenize_spans), f)


def write_plot(path: str, records: list[StepRecord]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'vserve[plot]'") from e
    steps = busy_steps(records)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([r.step_id for r in steps], [(r.forward_end - r.forward_start) * 1e3 for r in steps],
            label="model forward (ms)")
    ax.plot([r.step_id for r in steps], [r.launch_interval * 1e3 for r in steps],
            label="step launch interval (ms)", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
