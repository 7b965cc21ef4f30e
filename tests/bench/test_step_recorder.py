"""The step recorder keeps recording after `max_records` steps (a long-running server's step
metrics must not freeze): both its stores hold the newest records, bounded. A schedule's
exposed time (`Coverage.exposed`, behind `scheduler_exposed_time_seconds`) subtracts the union
of the forward spans, so overlapping pipeline-parallel spans count once."""

from types import SimpleNamespace

import pytest

from tests.support.fakes import FakeExecutor, core_request, fake_engine_config
from vserve.core.sched_output import StepTiming
from vserve.engine.core import EngineCore
from vserve.engine.recorder import Coverage, StepRecorder


def _record_steps(rec: StepRecorder, step_ids) -> None:
    for i in step_ids:
        so = SimpleNamespace(step_id=i, total_num_scheduled_tokens=1, num_scheduled_tokens={"r": 1})
        rec.scheduled(so, float(i), i + 0.1, 0)
        out = SimpleNamespace(timing=StepTiming(i, i + 0.2, i + 0.7, i + 0.8))
        rec.committed(so, out, i + 0.9, i + 0.95)


def test_recorder_keeps_the_newest_records_after_max_records():
    rec = StepRecorder(max_records=10)
    _record_steps(rec, range(20))
    recent = rec.drain_recent()
    assert [r.step_id for r in recent] == list(range(10, 20))
    assert [r.step_id for r in rec.take()] == list(range(10, 20))
    _record_steps(rec, range(20, 25))  # still recording after a take
    assert [r.step_id for r in rec.drain_recent()] == list(range(20, 25))
    assert [r.step_id for r in rec.take()] == list(range(20, 25))


def test_engine_step_metrics_keep_updating_past_max_records():
    core = EngineCore(fake_engine_config(async_scheduling=True), FakeExecutor())
    core.recorder = StepRecorder(max_records=10)
    core.add_request(core_request("r", [1, 2, 3], max_tokens=30))
    forward_counts = []
    while core.has_work():
        if core.step_fn() is not None:
            forward_counts.append(len(core.make_stats().forward_times))
    assert len(forward_counts) >= 20
    assert all(n >= 1 for n in forward_counts[-5:]), forward_counts


def test_a_server_holds_a_bounded_ring_of_small_records():
    """A server never takes its records: what it holds is the default ring, of slotted records
    (a 30-minute soak grew the engine core by 15 MiB with a 100k-record ring of dicts)."""
    import sys

    from vserve.engine.recorder import MAX_RECORDS, StepRecord

    rec = StepRecorder()
    assert rec.max_records == MAX_RECORDS <= 16384
    _record_steps(rec, range(MAX_RECORDS + 5))
    assert len(rec.records) == MAX_RECORDS
    assert not hasattr(StepRecord(1, 1, 1, 0, 0.0, 0.0), "__dict__")
    assert sys.getsizeof(rec.records[MAX_RECORDS]) < 300


def test_exposed_subtracts_a_forward_inside_the_window():
    assert Coverage([(2.0, 5.0)]).exposed(0.0, 10.0) == 7.0


def test_exposed_counts_overlapping_forwards_once():
    # PP stages overlap: the union of (1, 5) and (3, 6) covers 1..6, not 4 + 3
    assert Coverage([(1.0, 5.0), (3.0, 6.0)]).exposed(0.0, 10.0) == 5.0
    assert (
        Coverage([(3.0, 6.0), (1.0, 5.0), (2.0, 4.0)]).exposed(0.0, 10.0) == 5.0
    )  # unsorted, nested


def test_exposed_clips_forwards_to_the_window():
    assert Coverage([(0.0, 3.0), (7.0, 12.0)]).exposed(2.0, 8.0) == 4.0
    assert Coverage([(0.0, 1.0), (9.0, 12.0)]).exposed(2.0, 8.0) == 6.0  # wholly outside
    assert Coverage([(0.0, 12.0), (3.0, 4.0)]).exposed(2.0, 8.0) == 0.0  # all covered


def test_exposed_without_forwards_is_the_whole_window():
    assert Coverage([]).exposed(1.0, 4.0) == 3.0


def test_the_plot_leaves_no_figure_open_and_the_backend_as_it_was(tmp_path):
    """`--plot` draws on a bare Figure: a process that plots run after run (a notebook, the
    test process) keeps no figure of pyplot's open, and its backend is not switched."""
    plt = pytest.importorskip("matplotlib.pyplot")
    import matplotlib

    from vserve.bench.trace import write_plot
    from vserve.engine.recorder import StepRecord

    records = [
        StepRecord(i, 8, 2, 0, 0.0, 0.001, forward_start=0.002, forward_end=0.01) for i in range(3)
    ]
    backend, open_figures = matplotlib.get_backend(), plt.get_fignums()
    for k in range(2):
        write_plot(str(tmp_path / f"{k}.png"), records)
        assert (tmp_path / f"{k}.png").read_bytes()[:4] == b"\x89PNG"
    assert plt.get_fignums() == open_figures
    assert matplotlib.get_backend() == backend
