"""The timeline of a run from its step records: a Chrome trace and a per-step plot.

`chrome_trace` turns the records into a Chrome trace (chrome://tracing, Perfetto): one CPU
lane per process (front end: detokenize; engine core: schedule, update), a device lane for the
worker (prepare: from receiving the step to its forward; forward), and one per PP stage when
the stages report their own spans, so the overlap report's figures can be checked against the
timeline.
"""

from __future__ import annotations

import json

from vserve.engine.recorder import StepRecord


def is_busy(r: StepRecord) -> bool:
    """The step ran tokens through a forward (empty steps are left out of every figure)."""
    return r.num_tokens > 0 and r.forward_end > 0


def busy_steps(records: list[StepRecord]) -> list[StepRecord]:
    return [r for r in records if is_busy(r)]


FRONTEND_PID, ENGINE_PID, WORKER_PID = 1, 2, 3
STAGE_TID = 10  # worker lanes of the PP stages' own forwards, when the stages report them


def chrome_trace(records: list[StepRecord], detokenize_spans=()) -> dict:
    steps = busy_steps(records)
    points = [t for r in steps for t in (r.schedule_start, r.forward_start)]
    points += [s for s, _ in detokenize_spans]
    t0 = min(points) if points else 0.0
    events = _lane_names()

    def slice_(name, pid, tid, start, end, **args):
        events.append(
            {
                "name": name,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": (start - t0) * 1e6,
                "dur": max(0.0, end - start) * 1e6,
                "args": args,
            }
        )

    for r in steps:
        info = dict(step=r.step_id, tokens=r.num_tokens, reqs=r.num_reqs)
        slice_("schedule", ENGINE_PID, 1, r.schedule_start, r.schedule_end, **info)
        if r.commit_end:
            slice_("update", ENGINE_PID, 2, r.commit_start, r.commit_end, **info)
        if r.recv:  # the worker's own host work before the forward: inputs, batch state
            slice_("prepare", WORKER_PID, 1, r.recv, r.forward_start, **info)
        slice_("forward", WORKER_PID, 1, r.forward_start, r.forward_end, **info)
        for stage, (start, end) in enumerate(r.stage_forwards):
            slice_("stage forward", WORKER_PID, STAGE_TID + stage, start, end, **info)
    num_stages = max((len(r.stage_forwards) for r in steps), default=0)
    events += [
        {
            "name": "thread_name",
            "ph": "M",
            "pid": WORKER_PID,
            "tid": STAGE_TID + i,
            "args": {"name": f"PP stage {i}"},
        }
        for i in range(num_stages)
    ]
    for start, end in detokenize_spans:
        slice_("detokenize", FRONTEND_PID, 1, start, end)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _lane_names() -> list[dict]:
    meta = []
    for pid, name in (
        (FRONTEND_PID, "front end (CPU)"),
        (ENGINE_PID, "engine core (CPU)"),
        (WORKER_PID, "worker (device)"),
    ):
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    for pid, tid, name in (
        (FRONTEND_PID, 1, "detokenize"),
        (ENGINE_PID, 1, "schedule"),
        (ENGINE_PID, 2, "update"),
        (WORKER_PID, 1, "forward"),
    ):
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        )
    return meta


def write_trace(path: str, records, detokenize_spans=()) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(records, detokenize_spans), f)


def write_plot(path: str, records: list[StepRecord]) -> None:
    """A PNG of each step's forward and launch interval. A bare `Figure` (no pyplot): no
    backend switched, no figure left open in the process that draws it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'vserve[plot]'") from e
    steps = busy_steps(records)
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    ax.plot(
        [r.step_id for r in steps],
        [(r.forward_end - r.forward_start) * 1e3 for r in steps],
        label="model forward (ms)",
    )
    ax.plot(
        [r.step_id for r in steps],
        [r.launch_interval * 1e3 for r in steps],
        label="step launch interval (ms)",
        alpha=0.8,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
