"""Triton compiles after start-up are counted and shown: the worker's counter takes Triton's
compile hook (keeping any hook set before it), each step reports the compiles made since the
one before, and the engine sums them into its stats, `/metrics` (`vserve:triton_compiles`)
and the bench's overlap report. The hook is driven by hand here: under the interpreter Triton
compiles nothing (the variants themselves are counted in tests/models/test_triton_variants.py
and tests/workers/test_memory_profile.py)."""

import pytest
from prometheus_client import generate_latest

from tests.support.fakes import FakeExecutor, FakeRunner, core_request, fake_engine_config
from vserve.bench.overlap import overlap_report
from vserve.core.sched_output import StepTiming
from vserve.engine.core import EngineCore
from vserve.entrypoints.openai.metrics import ServerMetrics
from vserve.workers import compile_count

triton = pytest.importorskip("triton")


@pytest.fixture
def fresh_counter(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(compile_count, "_state", {"installed": False, "count": 0, "taken": 0})
    return knobs.runtime


def _compile(runtime):
    """What Triton does before compiling a variant it does not hold."""
    return runtime.jit_cache_hook(
        key="k", repr="r", fn=None, compile={}, is_manual_warmup=False, already_compiled=False
    )


def test_each_compile_is_counted_once_and_taken_once(fresh_counter):
    compile_count.install()
    compile_count.install()  # idempotent: one hook, one count per compile
    for _ in range(3):
        assert not _compile(fresh_counter)  # never tells Triton to skip the compile
    assert compile_count.total() == 3
    assert compile_count.take() == 3
    assert compile_count.take() == 0
    _compile(fresh_counter)
    assert (compile_count.total(), compile_count.take()) == (4, 1)


def test_a_hook_set_before_keeps_being_called_and_answering(fresh_counter):
    seen = []

    def earlier(**kwargs):
        seen.append(kwargs["key"])
        return True  # (a hook may tell Triton to skip the compile: its answer stands)

    fresh_counter.jit_cache_hook = earlier
    compile_count.install()
    assert _compile(fresh_counter) is True
    assert seen == ["k"] and compile_count.total() == 1


class CompilingRunner(FakeRunner):
    """The first three steps each report one compile (a new batch shape), later ones none."""

    executed = 0

    def execute(self, so):
        out = super().execute(so)
        self.executed += 1
        out.timing = StepTiming(compiles=1 if self.executed <= 3 else 0)
        return out


def test_the_engine_sums_step_compiles_into_stats_metrics_and_the_report():
    core = EngineCore(fake_engine_config(), FakeExecutor(runner=CompilingRunner()))
    core.add_request(core_request("r", [1, 2, 3], max_tokens=8))
    metrics = ServerMetrics("m")
    while core.has_work():
        core.step_fn()
        metrics.on_stats(core.make_stats())  # cumulative: counted once however often sent
    assert core.make_stats().triton_compiles == 3
    text = generate_latest(metrics.registry).decode()
    assert 'vserve:triton_compiles_total{engine="0",model_name="m"} 3.0' in text
    report = overlap_report(core.recorder.take())
    assert report.triton_compiles == 3
