"""The overlap report on synthetic step records (no engine, no timing): hidden, exposed and
stretched host work, PP overlap. The report must never score a slower run higher.

Times are in seconds on a made-up clock. F is the calibrated (unstretched) forward, S and C
the engine core's schedule and commit time per step.
"""

import pytest

from vserve.bench.overlap import overlap_report
from vserve.engine.recorder import Coverage, StepRecord

F, S, C = 0.004, 0.001, 0.001
N = 40  # steps per synthetic run
TOKENS = 256  # decode steps of 256 sequences


def _record(step_id, sched, fwd, commit, interval, stages=(), tokens=TOKENS, reason=None):
    r = StepRecord(
        step_id,
        tokens,
        tokens,
        0,
        sched[0],
        sched[1],
        commit[0],
        commit[1],
        forward_start=fwd[0],
        forward_end=fwd[1],
        launch_interval=interval,
        no_overlap=reason,
    )
    r.stage_forwards = [tuple(s) for s in stages]
    return r


def sync_run(n=N, fwd=F, t0=0.0, first_id=0, reason="async scheduling off: test"):
    """One step at a time: schedule, forward, commit; host work fully exposed."""
    records, t, last_launch = [], t0, None
    for i in range(n):
        launch = t + S
        interval = launch - last_launch if last_launch is not None else 0.0
        f = (launch, launch + fwd)
        records.append(
            _record(first_id + i, (t, launch), f, (f[1], f[1] + C), interval, reason=reason)
        )
        t, last_launch = f[1] + C, launch
    return records


def async_run(n=N, stretch=0.0):
    """Depth 2: the worker runs forwards back to back; step k is scheduled (and step k-2
    committed) while forward k-1 runs. `stretch`: host work on the forward's cores makes
    every forward that much longer (F + S + C: the host work merely moved onto them)."""
    fwd = F + stretch
    records = []
    for k in range(n):
        f = (k * fwd, (k + 1) * fwd)
        sched_start = (k - 1) * fwd + C  # step 0: before anything runs
        commit = ((k + 2) * fwd, (k + 2) * fwd + C) if k + 2 < n else (f[1], f[1] + C)
        interval = fwd if k else 0.0
        records.append(_record(k, (sched_start, sched_start + S), f, commit, interval))
    return records


def elapsed(records):
    return max(r.commit_end for r in records) - min(r.schedule_start for r in records)


# -- the three single-stage cases ----------------------------------------------------------------
def test_fully_exposed_host_work():
    rep = overlap_report(sync_run())
    assert rep.num_steps == N
    assert rep.host_total_ms == pytest.approx(N * (S + C) * 1e3)
    assert rep.host_exposed_ms == pytest.approx(rep.host_total_ms)
    assert rep.host_hidden_ms == pytest.approx(0.0, abs=1e-9)
    assert rep.host_hidden_net_share == pytest.approx(0.0, abs=1e-9)
    assert rep.forward_slowdown == pytest.approx(1.0)
    assert rep.calibrated_steps == N - 1 and rep.calibration == "this run's quiet steps"
    assert rep.overlap_efficiency == pytest.approx(F / (F + S + C))
    assert rep.steps_without_overlap == {"async scheduling off: test": N}


def test_fully_hidden_host_work():
    rep = overlap_report(async_run(), calibration=sync_run())
    # only the first schedule and the last commit have no forward beside them
    assert rep.host_exposed_ms == pytest.approx((S + C) * 1e3)
    assert rep.host_hidden_ms == pytest.approx((N - 1) * (S + C) * 1e3)
    assert rep.forward_slowdown == pytest.approx(1.0)
    assert rep.host_hidden_net_share == pytest.approx((N - 1) / N)
    assert rep.overlap_efficiency == pytest.approx(1.0)
    assert rep.calibration == "the sync run" and rep.calibrated_steps == N - 1


def test_stretched_forward_shows_slowdown_and_does_not_score_higher():
    """Host work lands on the forward's cores: every forward grows by S + C, the interval
    with it. No faster than sync, so no better a score; the old figure would say 1.0."""
    sync = overlap_report(sync_run())
    stretched = overlap_report(async_run(stretch=S + C), calibration=sync_run())
    assert stretched.forward_slowdown == pytest.approx((F + S + C) / F)
    assert stretched.forward_slowdown > 1
    assert stretched.overlap_efficiency <= sync.overlap_efficiency + 1e-9
    assert stretched.host_hidden_net_share == pytest.approx(0.0, abs=1e-9)
    # what the old figure did: it called the stretched run perfect
    assert stretched.stretched_forward_over_interval == pytest.approx(1.0)
    assert sync.stretched_forward_over_interval < 0.7


@pytest.mark.parametrize("stretch", [0.0, 0.5 * (S + C), 1.5 * (S + C), 3 * (S + C)])
def test_a_slower_run_never_scores_higher(stretch):
    """Against the sync run of the same workload (the tie, stretch = S + C, is above)."""
    sync_records = sync_run()
    sync = overlap_report(sync_records)
    run = async_run(stretch=stretch)
    rep = overlap_report(run, calibration=sync_records)
    slower = elapsed(run) > elapsed(sync_records)
    assert (rep.overlap_efficiency < sync.overlap_efficiency) == slower
    assert rep.forward_slowdown == pytest.approx((F + stretch) / F)


def test_efficiency_falls_as_the_forward_stretches():
    sync_records = sync_run()
    scores = [
        overlap_report(async_run(stretch=x), calibration=sync_records).overlap_efficiency
        for x in (0.0, 0.0005, 0.001, 0.002, 0.004)
    ]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)


# -- calibration -----------------------------------------------------------------------------------
def test_calibrates_on_the_runs_own_quiet_steps():
    """Without a sync run: an async run's quiet step (launched after idle, nothing beside it)
    of the same shape calibrates the stretched ones."""
    quiet = sync_run(n=1, t0=1.0, first_id=N, reason="first step after idle")
    rep = overlap_report(async_run(stretch=S + C) + quiet)
    # the run's first step is left out (start-up costs); the quiet one counts
    assert rep.calibration == "this run's quiet steps" and rep.calibrated_steps == N
    expected = ((N - 1) * (F + S + C) + F) / (N * F)
    assert rep.forward_slowdown == pytest.approx(expected)


def test_a_cold_first_step_is_left_out():
    """Start-up costs land on each run's first step (here 100x and 30x the forward): they
    neither calibrate nor count as slowdown."""
    calibration, run = sync_run(), async_run()
    calibration[0].forward_end += 99 * F
    run[0].forward_end += 29 * F
    rep = overlap_report(run, calibration=calibration)
    assert rep.forward_slowdown == pytest.approx(1.0)
    assert rep.overlap_efficiency == pytest.approx(1.0)


def test_no_quiet_step_and_no_sync_run_gives_no_score():
    rep = overlap_report(async_run(stretch=S + C))
    assert rep.overlap_efficiency is None and rep.forward_slowdown is None
    assert rep.host_hidden_net_share is None and rep.calibrated_steps == 0
    assert "n/a" in rep.format() and "none (--compare-sync calibrates)" in rep.format()
    assert rep.stretched_forward_over_interval == pytest.approx(1.0)


def test_other_shapes_are_not_calibrated():
    calibration = sync_run()
    for r in calibration:
        r.num_tokens = r.num_reqs = 128
    rep = overlap_report(async_run(), calibration=calibration)
    assert rep.calibrated_steps == 0 and rep.overlap_efficiency is None


def test_intervals_across_idle_are_left_out():
    """Two batches with an idle second between them (as `bench latency` runs): the gap is no
    launch interval, so the efficiency is that of either batch alone."""
    first = sync_run(n=10)
    second = sync_run(n=10, t0=first[-1].commit_end + 1.0, first_id=10)
    rep = overlap_report(first + second)
    assert rep.overlap_efficiency == pytest.approx(F / (F + S + C))
    assert rep.mean_launch_interval_ms == pytest.approx((F + S + C) * 1e3)


def _shift(r, ids, dt):
    r.step_id += ids
    for name in (
        "schedule_start",
        "schedule_end",
        "commit_start",
        "commit_end",
        "forward_start",
        "forward_end",
    ):
        setattr(r, name, getattr(r, name) + dt)
    return r


# -- PP --------------------------------------------------------------------------------------------
G = 0.003  # each stage's forward


def pp_run(n=N, pipelined=True):
    """Two stages. Pipelined: step k runs on stage 1 while step k+1 runs on stage 0, and the
    engine launches one step per G. Not pipelined: stage 0 starts step k+1 only after stage 1
    finished step k (one step at a time on the device)."""
    period = G if pipelined else 2 * G
    records = []
    for k in range(n):
        s0 = (k * period, k * period + G)
        s1 = (s0[1], s0[1] + G)
        sched = ((k - 1) * period + C, (k - 1) * period + C + S)
        commit = (s1[1], s1[1] + C)
        records.append(_record(k, sched, s1, commit, period if k else 0.0, stages=(s0, s1)))
    return records


def pp_sync_run(n=N):
    records, t, last = [], 0.0, None
    for k in range(n):
        launch = t + S
        s0, s1 = (launch, launch + G), (launch + G, launch + 2 * G)
        records.append(
            _record(
                k,
                (t, launch),
                s1,
                (s1[1], s1[1] + C),
                launch - last if last is not None else 0.0,
                stages=(s0, s1),
            )
        )
        t, last = s1[1] + C, launch
    return records


def test_pp_overlap_several_steps_in_flight():
    rep = overlap_report(pp_run(), calibration=pp_sync_run())
    assert [s["stage"] for s in rep.stages] == [0, 1]
    for s in rep.stages:
        assert s["mean_forward_ms"] == pytest.approx(G * 1e3)
        assert s["mean_interval_ms"] == pytest.approx(G * 1e3)
        assert s["calibrated_forward_ms"] == pytest.approx(G * 1e3)
    assert rep.forward_slowdown == pytest.approx(1.0)
    assert rep.overlap_efficiency == pytest.approx(1.0)
    # host work under two overlapping forwards is counted once
    assert rep.host_hidden_ms <= rep.host_total_ms + 1e-9
    assert rep.host_hidden_ms == pytest.approx(rep.host_total_ms - (S + C) * 1e3, rel=1e-6)
    assert "PP stage" in rep.format()


def test_pp_without_pipelining_scores_lower():
    calibration = pp_sync_run()
    pipelined = overlap_report(pp_run(), calibration=calibration)
    serial = overlap_report(pp_run(pipelined=False), calibration=calibration)
    assert elapsed(pp_run(pipelined=False)) > elapsed(pp_run())
    assert serial.overlap_efficiency == pytest.approx(0.5)
    assert serial.overlap_efficiency < pipelined.overlap_efficiency
    bottleneck = serial.stages[serial.bottleneck_stage]
    assert bottleneck["mean_interval_ms"] / bottleneck["mean_forward_ms"] == pytest.approx(2.0)


def moving_bottleneck_run(n=N):
    """Pipelined at the pace of the slower stage, which is stage 0 for the first half (long
    prefill-like forwards) and stage 1 (the lm_head) for the second."""
    records, t = [], 0.0
    for k in range(n):
        g0, g1 = (2 * G, G / 2) if k < n // 2 else (G / 2, 2 * G)
        s0 = (t, t + g0)
        s1 = (max(s0[1], records[-1].stage_forwards[1][1]) if records else s0[1],)
        s1 = (s1[0], s1[0] + g1)
        sched = (t - S, t)
        records.append(_record(k, sched, s1, (s1[1], s1[1] + C), 2 * G if k else 0.0, (s0, s1)))
        t += 2 * G
    return records


def test_pp_pace_follows_the_bottleneck_from_step_to_step():
    """A stage that never waits paces 1.0, wherever the bottleneck sits; one mean stage over
    the whole run would call the pipeline slow (its forward averages the short and the long
    half, its interval does not)."""
    rep = overlap_report(moving_bottleneck_run())
    assert rep.bottleneck_interval_over_forward == pytest.approx(1.0, rel=0.02)
    whole_run = rep.stages[rep.bottleneck_stage]
    assert whole_run["mean_interval_ms"] / whole_run["mean_forward_ms"] > 1.5
    # a decode step whose lm_head stage then waits while stage 0 prefills a long chunk: the
    # wait is the prefill's pace, not the decode step's
    records, t = [], 0.0
    for k, (g0, g1) in enumerate([(G / 2, G), (10 * G, G / 2), (G / 2, G), (G / 2, G)]):
        s0 = (t, t + g0)
        s1 = (max(s0[1], records[-1].stage_forwards[1][1]) if records else s0[1],)
        s1 = (s1[0], s1[0] + g1)
        records.append(_record(k, (t - S, t), s1, (s1[1], s1[1] + C), g0 if k else 0.0, (s0, s1)))
        t = s0[1]
    assert overlap_report(records).bottleneck_interval_over_forward < 1.15
    serial = overlap_report(pp_run(pipelined=False), calibration=pp_sync_run())
    assert serial.bottleneck_interval_over_forward == pytest.approx(2.0)
    assert overlap_report(sync_run()).bottleneck_interval_over_forward is None  # one stage


def test_coverage_counts_overlapping_spans_once():
    cov = Coverage([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.6)])
    assert cov.covered(0.0, 10.0) == pytest.approx(4.0)
    assert cov.covered(1.5, 5.5) == pytest.approx(2.0)
    assert cov.covered(3.0, 5.0) == 0.0


def test_report_dict_keeps_the_old_figure_under_its_own_name():
    d = overlap_report(async_run(stretch=S + C), calibration=sync_run()).to_dict()
    assert "stretched_forward_over_interval" in d and "overlap_efficiency" in d
    assert d["overlap_efficiency"] != d["stretched_forward_over_interval"]


def test_a_calibration_slower_than_the_run_is_flagged():
    """A sync run on a busier machine calibrates forwards longer than the run's own: the
    report says so instead of presenting an efficiency above 1 as a result."""
    rep = overlap_report(async_run(), calibration=sync_run(fwd=2 * F))
    assert rep.forward_slowdown == pytest.approx(0.5)
    assert rep.warning and "not to be trusted" in rep.format()
    assert overlap_report(async_run(), calibration=sync_run()).warning is None


def spec_like_run(n=N):
    """Async with nothing schedulable ahead (drafts wait for the previous step's tokens):
    after each launch an empty step is launched at once, and the next busy step only after
    the commit. One step at a time, like sync, with no reason recorded by the engine."""
    records, t, last_launch, step_id = [], 0.0, None, 0
    for _ in range(n):
        launch = t + S
        interval = launch - last_launch if last_launch is not None else 0.0
        f = (launch, launch + F)
        records.append(_record(step_id, (t, launch), f, (f[1], f[1] + C), interval))
        empty = StepRecord(step_id + 1, 0, 0, 1, launch + 1e-5, launch + 2e-5, launch_interval=2e-5)
        records.append(empty)
        t, last_launch, step_id = f[1] + C, empty.schedule_end, step_id + 2
    for r, nxt in zip(records, records[1:]):
        nxt.launch_interval = nxt.schedule_end - r.schedule_end if nxt.launch_interval else 0
    return records


def test_empty_steps_between_do_not_shorten_the_interval():
    rep = overlap_report(spec_like_run())
    assert rep.num_steps == N
    assert rep.overlap_efficiency == pytest.approx(F / (F + S + C))
    assert rep.steps_without_overlap == {}
    assert rep.serialized_steps == N - 1


def test_serialized_steps_by_the_timestamps():
    assert overlap_report(sync_run()).serialized_steps == N - 1
    assert overlap_report(async_run()).serialized_steps == 0
    assert overlap_report(pp_run()).serialized_steps == 0


def test_parked_steps_are_counted_and_shown():
    records = async_run()
    for r in records[::2]:
        r.parked = True
    rep = overlap_report(records)
    assert rep.parked_steps == N // 2 and overlap_report(sync_run()).parked_steps == 0
    line = next(x for x in rep.format().splitlines() if x.startswith("Steps prepared in a"))
    assert line.split()[-1] == f"{N // 2}/{N}"


def test_device_forward_times_are_reported_where_steps_carry_them():
    """CUDA steps carry their forward's device time (events): the report shows its mean and
    the share of the launch interval the device was busy; CPU steps carry none and the rows
    stay out."""
    cpu = overlap_report(async_run())
    assert cpu.mean_device_forward_ms is None and cpu.device_busy_share is None
    assert "Mean device span" not in cpu.format()
    records = async_run()
    for r in records:
        r.device_forward = 0.003  # of a 4 ms interval
    rep = overlap_report(records)
    assert rep.mean_device_forward_ms == pytest.approx(3.0)
    assert rep.device_busy_share == pytest.approx(0.75)
    lines = {x[:50].strip(): x.split()[-1] for x in rep.format().splitlines()}
    assert lines["Mean device span of a forward (ms):"] == "3.00"


def test_trace_has_a_lane_per_pp_stage():
    from vserve.bench.trace import chrome_trace

    events = chrome_trace(pp_run(n=4))["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"PP stage 0", "PP stage 1", "forward", "schedule"} <= lanes
    stage = [e for e in events if e["name"] == "stage forward"]
    assert len(stage) == 8
    assert all(e["dur"] == pytest.approx(G * 1e6) for e in stage)
