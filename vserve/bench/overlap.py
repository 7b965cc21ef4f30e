"""The overlap report: what overlapping host work with the forward buys, from per-step records.

The engine core records, for every step, schedule start and end (the end is the launch) and
commit start and end; the worker adds its forward start and end (forward + sampling), and PP
stages their own forward spans when they report them. One monotonic clock per host. Measuring
a forward against the launch interval alone rewards a slower run: host work that lands on the
forward's cores stretches the forward and the interval alike, and their ratio rises. So every
figure below that judges overlap compares with the *calibrated* forward, the forward of the
same batch shape with no host work beside it:

* host work: the engine core's per-step work, scheduling and committing each step (front-end
  detokenization runs beside the forward in sync and async mode alike and is left out).
* quiet forward: one that host work covers for at most `QUIET_SHARE` of its length (the engine
  core was blocked or idle meanwhile): every forward of a sync run; in an async run only those
  with nothing scheduled beside them.
* calibrated forward, per batch shape (PP stage, num tokens, num seqs): the mean quiet forward
  of that shape in the calibration records, those of a sync run of the same workload and
  engine args (`--compare-sync`) when there is one, else this run's own quiet steps. Steps
  whose shape has none are left out of the figures below (`calibrated_steps` counts the rest),
  and so is each run's first step, which carries one-time start-up costs.
* forward slowdown = sum of forwards / sum of their calibrated forwards: > 1 when host work
  beside the forward stretched it.
* overlap efficiency (the headline) = sum of the bottleneck stage's calibrated forwards / sum
  of the times from each step's launch to the next busy step's (empty steps launched between
  count as part of it): the share of each step that unstretched device work fills. For one
  workload the calibrated forwards are fixed, so a run with longer steps always scores lower.
* host hidden, net = (host time covered by some forward - the forwards' stretch) / host time,
  the stretch being total forward time x (1 - 1 / slowdown): host work that merely moved onto
  the forward's cores hides nothing.
* stretched forward / interval: the old "efficiency" (measured forward / launch interval),
  kept under this name because it rises when overlap stretches the forward; not a score.

Without a sync run the calibration rests on the run's own quiet steps, which an async run has
few of, and on host work the engine core records (the worker's reply thread is not recorded),
so `--compare-sync` is the sound source. With PP the interval of a stage runs from one step's
forward start on that stage to the next step's; the bottleneck is the stage with the longest
mean forward. The pipeline's pace is judged step by step, on each step's own bottleneck (the
stage with that step's longest forward, which moves from the first stage in prefill to the
lm_head's in decode): the time from its start there to the next step's start on that step's
bottleneck, over its forward there, summed over the steps. The report also
gives TPOT p50 / p99 and the steps launched with no other step in flight: by the reason the
engine gave, and by the timestamps (launched after every earlier step committed; an empty step
in the queue hides such a step from the engine's count). The timeline of the same records:
`vserve.bench.trace`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from vserve.bench.stats import percentile, request_tpots
from vserve.bench.trace import busy_steps, is_busy
from vserve.engine.recorder import Coverage, Span, StepRecord

QUIET_SHARE = 0.02  # host work may stretch a quiet forward by at most this share
FASTER_THAN_CALIBRATION = 0.9  # a slowdown below this: the calibration is not to be trusted
ShapeKey = tuple[int, int, int]  # (PP stage, num tokens, num seqs)


@dataclass
class StageFigures:
    stage: int
    mean_forward_ms: float
    mean_interval_ms: float  # forward start to the next step's, on this stage
    calibrated_forward_ms: float | None


@dataclass
class OverlapReport:
    num_steps: int
    mean_forward_ms: float
    mean_launch_interval_ms: float
    overlap_efficiency: float | None  # calibrated forward / interval (the headline)
    forward_slowdown: float | None  # forward / calibrated forward
    calibrated_steps: int  # steps whose shape has a calibrated forward
    calibration: str  # where the calibrated forwards come from
    host_total_ms: float
    host_hidden_ms: float  # covered by some forward (before the stretch)
    host_exposed_ms: float
    host_hidden_net_share: float | None  # hidden less the stretch, over total
    schedule_total_ms: float
    schedule_exposed_ms: float
    stretched_forward_over_interval: float  # the old figure: rewards stretched forwards
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    bottleneck_stage: int = 0
    # PP: time from each step's start on its slowest stage to the next step's on its own,
    # over those forwards (summed over the steps)
    bottleneck_interval_over_forward: float | None = None
    stages: list[dict] = field(default_factory=list)
    steps_without_overlap: dict[str, int] = field(default_factory=dict)
    serialized_steps: int = 0  # by the timestamps: nothing in flight beside them
    # inputs made in a gap whose other worker threads slept, the host work beside them
    # (workers/host_gap.py)
    parked_steps: int = 0
    # CUDA: the device span of the forward and sampling (events before and after them), and
    # that over the launch interval, an upper bound of how busy the device was (the span
    # includes the device's idle time inside the step); None where steps carry no device
    # times (CPU: the forward above is already the device's)
    mean_device_forward_ms: float | None = None
    device_busy_share: float | None = None
    # Triton compiles in the workers during the run's steps (CUDA; a warmed engine has none)
    triton_compiles: int = 0
    warning: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        rows = [
            ("Steps (with tokens):", str(self.num_steps)),
            ("Mean model forward time (ms):", f"{self.mean_forward_ms:.2f}"),
            ("Mean step launch interval (ms):", f"{self.mean_launch_interval_ms:.2f}"),
            ("Forward slowdown under overlap:", _fmt(self.forward_slowdown, 3)),
            ("Overlap efficiency (calibrated fwd / interval):", _fmt(self.overlap_efficiency, 3)),
            (
                f"  calibrated on {self.calibration}:",
                f"{self.calibrated_steps}/{self.num_steps} steps"
                if self.calibrated_steps
                else "none (--compare-sync calibrates)",
            ),
            ("Host time hidden, net of the slowdown:", _fmt(self.host_hidden_net_share, 3)),
            ("Host time total (schedule + commit, ms):", f"{self.host_total_ms:.2f}"),
            ("  under a forward (ms):", f"{self.host_hidden_ms:.2f}"),
            ("  exposed (ms):", f"{self.host_exposed_ms:.2f}"),
            (
                "Scheduler time total / exposed (ms):",
                f"{self.schedule_total_ms:.2f} / {self.schedule_exposed_ms:.2f}",
            ),
            (
                "Stretched fwd / interval (old, not a score):",
                f"{self.stretched_forward_over_interval:.3f}",
            ),
        ]
        if len(self.stages) > 1:
            rows += _stage_rows(self.stages, self.bottleneck_stage)
            rows.append(
                (
                    "PP pace (interval / forward of each step's slowest stage):",
                    _fmt(self.bottleneck_interval_over_forward, 3),
                )
            )
        rows += [
            ("TPOT p50 (ms):", _fmt(self.tpot_p50_ms)),
            ("TPOT p99 (ms):", _fmt(self.tpot_p99_ms)),
            ("Steps without overlap:", str(sum(self.steps_without_overlap.values()))),
        ]
        rows += [
            (f"  {reason}", str(n)) for reason, n in sorted(self.steps_without_overlap.items())
        ]
        rows.append(("  by the timestamps (no step in flight):", str(self.serialized_steps)))
        rows.append(("Steps prepared in a parked gap:", f"{self.parked_steps}/{self.num_steps}"))
        if self.mean_device_forward_ms is not None:
            rows.append(
                ("Mean device span of a forward (ms):", f"{self.mean_device_forward_ms:.2f}")
            )
            rows.append(
                ("Device span / interval (busy, at most):", _fmt(self.device_busy_share, 3))
            )
            rows.append(("Triton compiles during the run:", str(self.triton_compiles)))
        lines = ["{s:{c}^64}".format(s=" Overlap report ", c="=")]
        lines += [
            f"{label:<50}{value:>14}" if len(label) <= 50 else f"{label}  {value}"
            for label, value in rows
        ]
        if self.warning:
            lines.append(f"Warning: {self.warning}")
        return "\n".join(lines + ["=" * 64])


def _stage_rows(stages: list[dict], bottleneck: int) -> list[tuple[str, str]]:
    rows = [("PP stage: forward / interval (ms):", "")]
    for s in stages:
        mark = " *" if s["stage"] == bottleneck else ""
        rows.append(
            (
                f"  stage {s['stage']}{mark}:",
                f"{s['mean_forward_ms']:.2f} / {s['mean_interval_ms']:.2f}",
            )
        )
    return rows


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# -- spans -----------------------------------------------------------------------------------------
def stage_spans(r: StepRecord) -> list[Span]:
    return [tuple(s) for s in r.stage_forwards] or [(r.forward_start, r.forward_end)]


def host_spans(records: list[StepRecord]) -> list[Span]:
    spans = [(r.schedule_start, r.schedule_end) for r in records]
    return spans + [(r.commit_start, r.commit_end) for r in records if r.commit_end]


def calibrated_forwards(records: list[StepRecord]) -> dict[ShapeKey, float]:
    """Mean quiet forward per (stage, num tokens, num seqs)."""
    host = Coverage(host_spans(records))
    quiet: dict[ShapeKey, list[float]] = {}
    for r in warm_steps(records):
        for stage, (start, end) in enumerate(stage_spans(r)):
            if end > start and host.covered(start, end) <= QUIET_SHARE * (end - start):
                quiet.setdefault((stage, r.num_tokens, r.num_reqs), []).append(end - start)
    return {key: statistics.fmean(v) for key, v in quiet.items()}


def warm_steps(records: list[StepRecord]) -> list[StepRecord]:
    """The busy steps but a run's first, which carries one-time start-up costs."""
    return busy_steps(sorted(records, key=lambda r: r.step_id))[1:]


# -- the report ------------------------------------------------------------------------------------
def overlap_report(
    records: list[StepRecord], request_outputs=(), calibration: list[StepRecord] | None = None
) -> OverlapReport:
    """`calibration`: the records of a sync run of the same workload (see the module doc);
    without it the run's own quiet steps calibrate."""
    records = sorted(records, key=lambda r: r.step_id)
    steps = busy_steps(records)
    calib = calibrated_forwards(calibration if calibration is not None else records)
    following = _following_busy(records)
    stages = _stage_figures(steps, following, calib)
    bottleneck = max(stages, key=lambda s: s.mean_forward_ms).stage if stages else 0
    slowdown, matched = _slowdown(steps[1:], calib)
    host = _host_figures(records, steps)
    fwd_total = sum(e - s for r in steps for s, e in stage_spans(r))
    net = None
    if slowdown is not None and host[0] > 0:
        stretch = max(0.0, fwd_total * (1 - 1 / slowdown))
        net = max(0.0, host[1] - stretch) / host[0]
    forwards = [r.forward_end - r.forward_start for r in steps]
    intervals = [r.launch_interval for r in steps if r.launch_interval > 0]
    mean_fwd = statistics.fmean(forwards) if forwards else 0.0
    mean_int = statistics.fmean(intervals) if intervals else 0.0
    tpots = request_tpots(request_outputs)
    device = [r.device_forward for r in steps if r.device_forward > 0]
    mean_device = statistics.fmean(device) if device else None
    return OverlapReport(
        num_steps=len(steps),
        mean_forward_ms=mean_fwd * 1e3,
        mean_launch_interval_ms=mean_int * 1e3,
        overlap_efficiency=_efficiency(steps[1:], following, bottleneck, calib),
        forward_slowdown=slowdown,
        calibrated_steps=matched,
        calibration="the sync run" if calibration is not None else "this run's quiet steps",
        host_total_ms=host[0] * 1e3,
        host_hidden_ms=host[1] * 1e3,
        host_exposed_ms=(host[0] - host[1]) * 1e3,
        host_hidden_net_share=net,
        schedule_total_ms=host[2] * 1e3,
        schedule_exposed_ms=host[3] * 1e3,
        stretched_forward_over_interval=(mean_fwd / mean_int) if mean_int else 0.0,
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        bottleneck_stage=bottleneck,
        bottleneck_interval_over_forward=_pace(steps, following) if len(stages) > 1 else None,
        stages=[asdict(s) for s in stages],
        steps_without_overlap=_no_overlap_reasons(steps),
        serialized_steps=serialized_steps(steps),
        parked_steps=sum(r.parked for r in steps),
        mean_device_forward_ms=None if mean_device is None else mean_device * 1e3,
        device_busy_share=(mean_device / mean_int)
        if mean_device is not None and mean_int
        else None,
        triton_compiles=sum(r.compiles for r in records),
        warning=_warning(slowdown),
    )


def _warning(slowdown: float | None) -> str | None:
    if slowdown is not None and slowdown < FASTER_THAN_CALIBRATION:
        return (
            "forwards ran faster than their calibration (a busier machine or a cold "
            "start during it): the calibrated figures are not to be trusted"
        )
    return None


def _key(r: StepRecord, stage: int) -> ShapeKey:
    return (stage, r.num_tokens, r.num_reqs)


def _slowdown(steps: list[StepRecord], calib: dict) -> tuple[float | None, int]:
    measured = base = 0.0
    matched = 0
    for r in steps:
        pairs = [(e - s, calib.get(_key(r, i))) for i, (s, e) in enumerate(stage_spans(r))]
        if pairs and all(b is not None for _, b in pairs):
            matched += 1
            measured += sum(m for m, _ in pairs)
            base += sum(b for _, b in pairs)
    return (measured / base if base > 0 else None), matched


def _efficiency(steps: list[StepRecord], following: dict, stage: int, calib: dict) -> float | None:
    """Calibrated forwards of `stage` over the time from each step's launch to the next busy
    step's (empty steps launched in between count as part of the interval)."""
    base = interval = 0.0
    for r in steps:
        b, nxt = calib.get(_key(r, stage)), following.get(r.step_id)
        if b is not None and nxt is not None:
            base += b
            interval += nxt.schedule_end - r.schedule_end
    return base / interval if interval > 0 else None


def serialized_steps(steps: list[StepRecord]) -> int:
    """Busy steps launched when every earlier busy step had already committed: nothing ran
    beside them, whatever the engine's reasons say (the first step is not counted)."""
    count, last_commit = 0, None
    for r in steps:
        if last_commit is not None and r.schedule_end >= last_commit:
            count += 1
        last_commit = max(last_commit or 0.0, r.commit_end or r.forward_end)
    return count


def _host_figures(records: list[StepRecord], steps: list[StepRecord]) -> tuple[float, ...]:
    """(host total, host under a forward, schedule total, schedule exposed), in seconds."""
    forwards = Coverage([span for r in steps for span in stage_spans(r)])
    schedules = [(r.schedule_start, r.schedule_end) for r in steps]
    commits = [(r.commit_start, r.commit_end) for r in steps if r.commit_end]
    sched_total = sum(e - s for s, e in schedules)
    sched_hidden = sum(forwards.covered(s, e) for s, e in schedules)
    commit_total = sum(e - s for s, e in commits)
    commit_hidden = sum(forwards.covered(s, e) for s, e in commits)
    return (
        sched_total + commit_total,
        sched_hidden + commit_hidden,
        sched_total,
        sched_total - sched_hidden,
    )


def _stage_figures(steps: list[StepRecord], following: dict, calib: dict) -> list[StageFigures]:
    """Per PP stage: mean forward, mean start-to-start interval, mean calibrated forward."""
    num_stages = max((len(stage_spans(r)) for r in steps), default=0)
    out = []
    for stage in range(num_stages):
        rows = [r for r in steps if len(stage_spans(r)) > stage]
        fwd = [stage_spans(r)[stage][1] - stage_spans(r)[stage][0] for r in rows]
        gaps = [
            stage_spans(following[r.step_id])[stage][0] - stage_spans(r)[stage][0]
            for r in rows
            if r.step_id in following and len(stage_spans(following[r.step_id])) > stage
        ]
        base = [calib[_key(r, stage)] for r in rows if _key(r, stage) in calib]
        out.append(
            StageFigures(stage, _mean_ms(fwd), _mean_ms(gaps), _mean_ms(base) if base else None)
        )
    return out


def _pace(steps: list[StepRecord], following: dict) -> float | None:
    """Sum of the times from each step's start on its slowest stage to the next busy step's
    start on *its* slowest stage, over the sum of those slowest forwards: 1 when the pipeline
    runs at the pace of whichever stage is slowest at the time. The sum telescopes to the
    run's time (idle gaps left out), so a stage that waits while another fills the pipeline
    (a decode step followed by a long prefill on the first stage) is not charged for it."""
    interval = forward = 0.0
    for r in steps:
        nxt = following.get(r.step_id)
        spans = stage_spans(r)
        if nxt is None or not spans or not stage_spans(nxt):
            continue
        interval += _slowest(nxt)[0] - _slowest(r)[0]
        forward += _slowest(r)[1] - _slowest(r)[0]
    return interval / forward if forward > 0 else None


def _slowest(r: StepRecord) -> tuple[float, float]:
    """The (start, end) of the step's longest stage forward (the first of equals)."""
    return max(stage_spans(r), key=lambda span: span[1] - span[0])


def _following_busy(records: list[StepRecord]) -> dict[int, StepRecord]:
    """step id -> the next busy step, when none of the steps up to it was after an idle."""
    out, prev = {}, None
    for r in records:
        if prev is not None and r.launch_interval <= 0:
            prev = None  # launched after idle: no interval spans the gap
        if is_busy(r):
            if prev is not None:
                out[prev.step_id] = r
            prev = r
    return out


def _mean_ms(values: list[float]) -> float:
    return statistics.fmean(values) * 1e3 if values else 0.0


def _no_overlap_reasons(steps: list[StepRecord]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for r in steps:
        if r.no_overlap:
            reasons[r.no_overlap] = reasons.get(r.no_overlap, 0) + 1
    return reasons
