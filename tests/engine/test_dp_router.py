"""Data-parallel routing and death rules without processes: the router's choice from load
figures (taken at most every 100 ms, assignments counted in between), pinning, and what the
front end sees when one engine dies (`_DPBase`)."""

import pytest

from vserve.engine.dp.client import _DPBase, combine
from vserve.engine.dp.router import LoadRouter
from vserve.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from vserve.engine.mp_client import EngineDeadError
from vserve.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_between_figures_spreads_evenly():
    router = LoadRouter([0, 1], clock=Clock())
    picks = [router.choose() for _ in range(100)]
    assert picks.count(0) == picks.count(1) == 50


def test_least_loaded_by_four_waiting_plus_running():
    clock = Clock()
    router = LoadRouter([0, 1, 2], clock=clock)
    router.publish(0, waiting=1, running=0)  # score 4
    router.publish(1, waiting=0, running=3)  # score 3
    router.publish(2, waiting=0, running=5)  # score 5
    assert router.choose() == 1  # now 4 + 3 = 7
    assert router.choose() == 0  # 4 < 5 and 7: now 8
    assert router.choose() == 2  # 5


def test_figures_are_taken_at_most_every_100_ms():
    clock = Clock()
    router = LoadRouter([0, 1], clock=clock)
    router.publish(0, 0, 0)
    router.publish(1, 0, 0)
    assert router.choose() == 0  # figures taken at t=0; engine 0 now counts 1 waiting
    router.publish(0, 0, 0)  # engine 0 says idle again, 50 ms later: not taken yet
    clock.now = 0.05
    assert router.choose() == 1
    assert router.choose() == 0  # 1 waiting each: the tie goes to rank 0
    clock.now = 0.2  # now the newest figure (idle) replaces the optimistic counts
    router.publish(1, waiting=3, running=0)
    assert [router.choose() for _ in range(3)] == [0, 0, 0]


def test_pinned_and_dead_engines():
    router = LoadRouter([0, 1], clock=Clock())
    assert [router.choose(pinned=1) for _ in range(3)] == [1, 1, 1]
    assert router.num_assigned == {0: 0, 1: 3}
    with pytest.raises(ValueError, match="not one of the ranks"):
        router.choose(pinned=2)
    router.remove(1)
    with pytest.raises(ValueError, match="engine 1 is dead"):
        router.choose(pinned=1)
    assert {router.choose() for _ in range(5)} == {0}


def test_combine_merges_answers():
    assert combine("process_memory", {0: {"engine_core": 1}, 1: {"engine_core": 2}}) == {
        "engine_core_dp0": 1,
        "engine_core_dp1": 2,
    }
    assert combine("take_step_records", {1: ["b"], 0: ["a"]}) == ["a", "b"]
    assert combine("reset_prefix_cache", {0: True, 1: False}) is False
    merged = combine(
        "stats",
        {
            0: {"num_running_reqs": 2, "kv_cache_usage": 0.5},
            1: {"num_running_reqs": 3, "kv_cache_usage": 0.1},
        },
    )
    assert merged["num_running_reqs"] == 5 and merged["kv_cache_usage"] == pytest.approx(0.3)


class _Fake(_DPBase):
    def __init__(self, keep_serving: bool) -> None:
        from types import SimpleNamespace

        self.clients = {r: SimpleNamespace(num_kv_blocks=8, dead_message=None) for r in (0, 1)}
        config = SimpleNamespace(data_parallel=SimpleNamespace(keep_serving=keep_serving))
        self._init_dp(config)
        self.pushed: list[EngineCoreOutputs] = []

    def _push(self, outs: EngineCoreOutputs) -> None:
        self.pushed.append(outs)


def _request(request_id: str, incarnation: int = 1) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2], SamplingParams(), [0], 0, incarnation=incarnation)


def _assign_four(dp: _Fake) -> dict[str, int]:
    return {rid: dp._assign(_request(rid), None) for rid in "abcd"}


@pytest.mark.parametrize("keep_serving", [False, True])
def test_one_engine_dies(keep_serving):
    dp = _Fake(keep_serving)
    ranks = _assign_four(dp)
    assert sorted(ranks.values()) == [0, 0, 1, 1]
    out = dp._on_outputs(EngineCoreOutputs(engine_error="boom", engine_index=1))
    assert out is not None
    if not keep_serving:  # the whole engine is dead: the front end fails everything
        assert out.engine_error == "data-parallel engine 1: boom"
        assert dp.dead_message == out.engine_error
        return
    assert out.engine_error is None  # only engine 1's requests fail, with the cause
    failed = {o.request_id for o in out.outputs}
    assert failed == {rid for rid, r in ranks.items() if r == 1}
    assert all(o.finish_reason == "error" and "boom" in o.error for o in out.outputs)
    assert all(o.incarnation == 1 for o in out.outputs)
    assert {dp._assign(_request(rid), None) for rid in "efg"} == {0}  # the rest serve
    # a straggler from the dead engine is dropped, a second error is no news
    assert dp._on_outputs(EngineCoreOutputs([EngineCoreOutput("b", [5])], engine_index=1)) is None
    assert dp._on_outputs(EngineCoreOutputs(engine_error="again", engine_index=1)) is None
    # the last engine's death is fatal
    last = dp._on_outputs(EngineCoreOutputs(engine_error="bang", engine_index=0))
    assert last is not None and last.engine_error == "data-parallel engine 0: bang"


@pytest.mark.parametrize("keep_serving", [False, True])
def test_a_death_its_client_knows_applies_before_the_queue_tells(keep_serving):
    """Engine 1's connection dropped while no request read the outputs: its client knows
    (dead_message), the death's message still waits in the queue. A request must not go
    there (a remote engine's death raised EngineDeadError at the send, even under
    keep-serving); the death rules apply at once and their outputs reach the queue."""
    dp = _Fake(keep_serving)
    ranks = _assign_four(dp)
    dp.clients[1].dead_message = "data-parallel engine 1 (remote) disconnected"
    if not keep_serving:
        with pytest.raises(EngineDeadError, match="engine 1 .remote. disconnected"):
            dp._assign(_request("e"), 1)
        assert [o.engine_error for o in dp.pushed] == [dp.dead_message]
        return
    assert {dp._assign(_request(rid), None) for rid in "efgh"} == {0}
    with pytest.raises(ValueError, match="engine 1 is dead"):
        dp._assign(_request("i"), 1)
    (failed,) = dp.pushed  # engine 1's requests finish with the cause
    assert {o.request_id for o in failed.outputs} == {r for r, k in ranks.items() if k == 1}
    assert all(o.finish_reason == "error" for o in failed.outputs)
    # the death's own message, read later, is no news
    assert dp._on_outputs(EngineCoreOutputs(engine_error="x", engine_index=1)) is None


def test_finished_requests_and_aborts_leave_the_books():
    dp = _Fake(keep_serving=True)
    ranks = _assign_four(dp)
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=2)
    done = EngineCoreOutput("a", [3], finish_reason="length", incarnation=1)
    dp._on_outputs(EngineCoreOutputs([done], stats, engine_index=ranks["a"]))
    assert "a" not in dp.owners
    assert dp.router.loads[ranks["a"]].latest == (2, 1)
    groups = dp._by_engine(["b", "c", "zz"])
    assert sorted(i for ids in groups.values() for i in ids) == ["b", "c"]
    assert set(dp.owners) == {"d"}
