"""Engine-loop tests: EngineCore step functions with a fake executor whose futures the test
controls (scenarios 18-23 of the async-scheduling reference)."""

import pytest

from tests.support.fakes import (
    FakeExecutor,
    FakeRunner,
    FakeStructured,
    core_request,
    expected_tokens,
    fake_engine_config,
)
from vserve.core.request import RequestStatus
from vserve.core.spec_decode import SpeculativeConfig
from vserve.engine.core import GRAMMAR_WAIT, EngineCore
from vserve.sampling_params import StructuredOutputsParams


def _core(depth_async=True, pp=1, executor=None, **cfg):
    config = fake_engine_config(async_scheduling=depth_async, pp=pp, **cfg)
    return EngineCore(config, executor or FakeExecutor())


def _drain(core, max_calls=1000):
    outputs = []
    for _ in range(max_calls):
        if not core.has_work():
            return outputs
        step = core.step_fn()
        assert len(core.batch_queue) <= core.depth
        if step is not None:
            outputs.extend(step)
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize(
    "async_on, pp, depth", [(False, 1, 1), (True, 1, 2), (True, 3, 4), (False, 2, 2)]
)
def test_s18_depth_order_and_drain(async_on, pp, depth):
    core = _core(async_on, pp)
    assert core.depth == depth
    prompts = {f"r{i}": list(range(i + 1, i + 9)) for i in range(4)}
    for k, p in prompts.items():
        core.add_request(core_request(k, p, max_tokens=6))
    outs = _drain(core)
    ex = core.executor
    assert ex.max_in_flight == depth  # the queue fills up, and no further
    assert ex.resolve_order == ex.launched  # committed in schedule order
    by_req = {}
    for o in outs:
        by_req.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert by_req == {k: expected_tokens(p, 6) for k, p in prompts.items()}
    assert not core.has_work() and core.step_fn() in (None, [])


def test_s19_failing_step_surfaces_its_exception():
    core = _core(True, executor=FakeExecutor(fail_at_step=3))
    core.add_request(core_request("a", [1, 2, 3], max_tokens=10))
    with pytest.raises(RuntimeError, match="forward failed at step 3"):
        _drain(core)


def test_s20_finished_ids_reach_workers_in_an_empty_step():
    runner = FakeRunner(eos_after={"a": 2})
    core = _core(True, executor=FakeExecutor(runner=runner))
    core.add_request(core_request("a", [1, 2, 3], max_tokens=10))
    _drain(core)
    last = runner.steps[-1]
    assert last.finished_req_ids == {"a"} and last.total_num_scheduled_tokens == 0


def test_s21_abort_while_step_in_flight_emits_nothing():
    ex = FakeExecutor()
    core = _core(True, executor=ex)
    core.add_request(core_request("a", [1, 2, 3], max_tokens=50))
    core.add_request(core_request("b", [4, 5, 6], max_tokens=5))
    emitted = []
    for _ in range(4):
        emitted.extend(core.step_fn() or [])
    before = sum(len(o.new_token_ids) for o in emitted if o.request_id == "a")
    aborted = []

    def abort_during_forward(future):
        if not aborted:  # the abort arrives from the input thread while the step runs
            core.abort_requests(["a"])
            aborted.append(future.so.step_id)

    ex.on_resolve.append(abort_during_forward)
    rest = _drain(core)
    assert aborted and all(o.request_id != "a" for o in rest)
    assert before > 0
    assert core.scheduler.kv.pool.num_used_blocks == 0


def test_s23_futures_resolve_fifo_from_mp_executor(tiny_model_dir):
    """Awaiting the 3rd future of the multiprocess executor resolves the 1st and 2nd first."""
    from tests.support.engines import make_llm

    llm = make_llm(tiny_model_dir("llama"), distributed_executor_backend="mp", max_model_len=128)
    core = llm.engine.client.core
    try:
        for i in range(3):
            core.add_request(core_request(f"r{i}", [2, 10 + i, 11, 12], max_tokens=20))
        sched, ex = core.scheduler, core.executor
        sos = [sched.schedule() for _ in range(3)]
        futures = [ex.execute_model(so) for so in sos]
        third = futures[2].result(timeout=30)
        assert third.step_id == sos[2].step_id
        assert len(ex.replies) == 2  # 1st and 2nd already read
        assert [f.result().step_id for f in futures[:2]] == [sos[0].step_id, sos[1].step_id]
        for so, f in zip(sos, futures):
            sched.update_from_output(so, f.result())
        sched.check_invariants()
    finally:
        llm.shutdown()


# -- structured output: the bitmask of a step waits for every older step of its requests --------
def _grammar_core(depth, runner, async_on=True):
    core = _core(async_on, executor=FakeExecutor(runner=runner))
    core.depth = depth  # the queue depth alone, whatever PP does with its steps
    core.structured = core.scheduler.structured = FakeStructured()
    return core


def _by_request(outputs):
    by_req = {}
    for o in outputs:
        by_req.setdefault(o.request_id, []).extend(o.new_token_ids)
    return by_req


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_grammar_bitmask_sees_every_earlier_token_at_any_depth(depth):
    """A grammar request admitted while another step is in flight sits in several queued
    steps at depth >= 3; each of its bitmasks must be filled after its grammar accepted every
    earlier output (B1), and after the step's forward was launched (B7a)."""
    runner = FakeRunner(check_grammar=True)
    core = _grammar_core(depth, runner, async_on=depth > 1)
    prompts = {"a": [1, 2, 3], "g0": [4, 5, 6], "g1": [7, 8], "g2": [9, 10, 11, 12]}
    core.add_request(core_request("a", prompts["a"], max_tokens=12))
    outputs = core.step_fn() or []  # a's first step is in flight when the grammars arrive
    grammar = StructuredOutputsParams(regex="[a-z]+")
    for k in ("g0", "g1", "g2"):
        core.add_request(core_request(k, prompts[k], max_tokens=10, structured_outputs=grammar))
    outputs += _drain(core)
    ex = core.executor
    assert _by_request(outputs) == {
        k: expected_tokens(p, 12 if k == "a" else 10) for k, p in prompts.items()
    }
    assert runner.num_grammar_rows == 30
    assert ex.resolve_order == ex.launched and ex.max_in_flight <= depth
    assert ex.masked_at_launch == []  # every bitmask was filled while its forward ran
    records = core.recorder.take()
    waited = {r.step_id for r in records if r.no_overlap == GRAMMAR_WAIT}
    assert waited == {so.step_id for so in runner.steps if so.pending_grammar}
    assert bool(waited) == (depth > 1)
    assert core.make_stats().no_overlap_steps.get(GRAMMAR_WAIT, 0) == len(waited)


# -- speculative decoding: requests without drafts overlap as without it -----------------------
NO_MATCH = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)
SPEC_WAIT = "speculative decoding: drafts need the previous step's tokens on the host"


def _spec_run(async_on, spec, prompts, period=None, penalties=False):
    core = _core(
        async_on, speculative=spec, executor=FakeExecutor(runner=FakeRunner(period=period))
    )
    extra = {"repetition_penalty": 1.2} if penalties else {}
    for k, p in prompts.items():
        core.add_request(core_request(k, p, max_tokens=12, **extra))
    outputs = _by_request(_drain(core))
    steps = [dict(so.num_scheduled_tokens) for so in core.executor.runner.steps]
    reasons = [r.no_overlap for r in core.recorder.take() if r.num_tokens]
    return outputs, steps, reasons, core


@pytest.mark.parametrize("case", ["no-match", "penalties"])
def test_spec_configured_no_draft_workload_runs_as_without_spec(case):
    """With speculative_config set and no request able to draft, the engine runs the same
    steps with the same overlap as without it, and the same tokens as the sync run."""
    if case == "no-match":  # random ids: no repeated 2-gram (checked), so no n-gram drafts
        spec, period, penalties = NO_MATCH, None, False
        prompts = {f"r{i}": [(37 * i + 11 * j) % 997 for j in range(8)] for i in range(4)}
        for p in prompts.values():
            seq = p + expected_tokens(p, 12)
            assert len(set(zip(seq, seq[1:]))) == len(seq) - 1
    else:  # repetitive text (drafts would match), but penalties
        spec, period, penalties = SpeculativeConfig(), 3, True
        prompts = {f"r{i}": [i + 1, i + 2, i + 3] * 3 for i in range(4)}
    outputs, steps, reasons, core = _spec_run(True, spec, prompts, period, penalties)
    plain = _spec_run(True, None, prompts, period, penalties)
    sync = _spec_run(False, spec, prompts, period, penalties)
    assert core.scheduler.spec_stats.num_drafts == 0
    assert steps == plain[1] and reasons == plain[2]
    assert SPEC_WAIT not in reasons
    assert outputs == plain[0] == sync[0]
    assert len(core.executor.launched) == len(plain[3].executor.launched)


def test_spec_wait_is_reported_for_a_request_with_drafts():
    prompts = {"rep": [5, 6, 7] * 4}
    outputs, steps, reasons, core = _spec_run(True, SpeculativeConfig(), prompts, period=3)
    assert outputs == {"rep": expected_tokens(prompts["rep"], 12, period=3)}
    assert core.scheduler.spec_stats.num_drafts > 0
    assert SPEC_WAIT in reasons


def test_first_step_of_a_new_wave_is_reported_after_idle():
    """The in-process client stops stepping once its requests finish, leaving an empty step
    (the finished ids) queued; the next wave's first step did not overlap anything."""
    core = _core(True)
    core.add_request(core_request("a", [1, 2, 3], max_tokens=4))
    finished = False
    while not finished:
        finished = any(o.finish_reason for o in core.step_fn() or [])
    assert core.batch_queue and not core.scheduler.running
    core.recorder.take()
    core.add_request(core_request("b", [4, 5, 6], max_tokens=4))
    _drain(core)
    first = core.recorder.take()[0]
    assert first.num_tokens and first.no_overlap == "first step after idle"
    assert first.launch_interval == 0.0


def test_eager_abort_spares_a_later_request_that_reuses_the_id():
    """Request x finished (say, on a stop string in the front end, which then
    sends ABORT x) and a new request x arrives at once. The eager abort was sent after ADD #1
    only, so it must not finish the new x (ADD #2), which would then never answer."""
    core = _core(True)
    core.add_request(core_request("x", [1, 2, 3], max_tokens=3), 1)
    _drain(core)
    core.abort_requests(["x"], 1)  # the input thread, eagerly
    core.scheduler.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)  # in order
    core.add_request(core_request("x", [4, 5, 6], max_tokens=4), 2)
    outs = _drain(core)
    assert [t for o in outs if o.request_id == "x" for t in o.new_token_ids] == expected_tokens(
        [4, 5, 6], 4
    )
    assert outs[-1].finish_reason == "length"
    core.add_request(core_request("y", [7, 8, 9], max_tokens=50), 3)
    core.step_fn()
    core.abort_requests(["y"], 3)  # an abort after its ADD still applies
    _drain(core)
    assert not core.scheduler.requests
