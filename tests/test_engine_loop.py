"""Engine-loop tests: EngineCore step functions with a fake executor whose futures the test
controls (scenarios 18-23 of the async-scheduling reference)."""

import pytest
from fakes import FakeExecutor, FakeRunner, core_request, expected_tokens, fake_engine_config

from vserve.engine.core import EngineCore


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


@pytest.mark.parametrize("async_on, pp, depth", [(False, 1, 1), (True, 1, 2), (True, 3, 4),
                                                 (False, 2, 2)])
def test_s18_depth_order_and_drain(async_on, pp, depth):
    core = _core(async_on, pp)
    assert core.depth == depth
    prompts = {f"r{i}": list(range(i + 1, i + 9)) for i in range(4)}
    for k, p in prompts.items():
        core.add_request(core_request(k, p, max_tokens=6))
    outs = _drain(core)
    ex = core.executor
    assert ex.max_in_flight <= depth
    assert ex.resolve_order == ex.launched           # committed in schedule order
    by_req = {}
    for o in outs:
        by_req.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert by_req == {k: expected_tokens(p, 6) for k, p in prompts.items()}
    assert not core.has_work() and core.step_fn() in (None, [])
    if async_on and pp == 1:
        assert ex.max_in_flight == 2


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
        if not aborted:   # the abort arrives from the input thread while the step runs
            core.abort_requests(["a"])
            aborted.append(future.so.step_id)

    ex.on_resolve.append(abort_during_forward)
    rest = _drain(core)
    assert aborted and all(o.request_id != "a" for o in rest)
    assert before > 0
    assert core.scheduler.kv.pool.num_used_blocks == 0


def test_s23_futures_resolve_fifo_from_mp_executor(tiny_model_dir):
    """Awaiting the 3rd future of the multiprocess executor resolves the 1st and 2nd first."""
    from conftest import make_llm

    llm = make_llm(tiny_model_dir("llama"), distributed_executor_backend="mp",
                   max_model_len=128)
    core = llm.engine.client.core
    try:
        for i in range(3):
            core.add_request(core_request(f"r{i}", [2, 10 + i, 11, 12], max_tokens=20))
        sched, ex = core.scheduler, core.executor
        sos = [sched.schedule() for _ in range(3)]
        futures = [ex.execute_model(so, non_block=True) for so in sos]
        third = futures[2].result(timeout=30)
        assert third.step_id == sos[2].step_id
        assert len(ex.replies) == 2                        # 1st and 2nd already read
        assert [f.result().step_id for f in futures[:2]] == [sos[0].step_id, sos[1].step_id]
        for so, f in zip(sos, futures):
            sched.update_from_output(so, f.result())
        sched.check_invariants()
    finally:
        llm.shutdown()
