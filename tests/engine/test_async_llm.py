"""`AsyncLLM` (the server's front end) keeps requests apart: a request that fails to reach
the engine leaves no state behind, an id can be reused right after its abort, and a failure
in the output handler or the socket reader marks the engine dead (every request gets an
error at once) instead of silently stopping delivery. Every wait is bounded: a hang fails."""

from __future__ import annotations

import asyncio

import pytest

from vserve import SamplingParams
from vserve.engine.arg_utils import EngineArgs
from vserve.engine.async_llm import AsyncLLM
from vserve.engine.mp_client import EngineDeadError

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

GREEDY = SamplingParams(temperature=0, max_tokens=4)
LONG = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)


def _engine(model_dir: str) -> AsyncLLM:
    return AsyncLLM.from_engine_args(
        EngineArgs(model=model_dir, dtype="float32", max_model_len=600)
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine on one event loop for the tests that leave it alive."""
    loop = asyncio.new_event_loop()
    llm = _engine(tiny_model_dir("llama"))
    yield llm, loop
    llm.shutdown()
    loop.run_until_complete(asyncio.sleep(0.1))  # let the cancelled tasks finish
    loop.close()


async def _collect(llm: AsyncLLM, request_id: str, params=GREEDY, prompt="a prompt"):
    """(every token id, the final finish reason) of one request."""
    token_ids, finish = [], None
    async for out in llm.generate(prompt, params, request_id):
        token_ids += out.outputs[0].token_ids
        finish = out.outputs[0].finish_reason
    return token_ids, finish


async def _bounded(coro, timeout: float = 30.0):
    return await asyncio.wait_for(coro, timeout)


async def _idle_engine(llm: AsyncLLM) -> dict:
    for _ in range(100):
        stats = await llm.call_utility("stats")
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            return stats
        await asyncio.sleep(0.05)
    return stats


def test_failed_send_leaves_no_state(engine, monkeypatch):
    """A send that fails (a frame that cannot be encoded) leaves no request state behind, and
    none of its children runs in the engine (they travel in one message)."""
    llm, loop = engine

    async def run():
        async def flaky(requests, *rank):
            raise OverflowError("injected: cannot encode")

        monkeypatch.setattr(llm.client, "add_requests_async", flaky)
        params = SamplingParams(n=2, temperature=1.0, max_tokens=400, ignore_eos=True)
        with pytest.raises(OverflowError):
            await llm.add_request("a prompt", params, "leaky")
        monkeypatch.undo()
        assert llm.num_unfinished == 0
        assert (await _bounded(_idle_engine(llm)))["kv_cache_usage"] == 0.0
        token_ids, finish = await _bounded(_collect(llm, "after"))
        assert len(token_ids) == 4 and finish == "length"

    loop.run_until_complete(run())


def test_id_reused_right_after_abort(engine):
    """abort_nowait(X) then a new X at once: the ADD used to overtake the ABORT, and the
    engine core died on the duplicate id (or, later, refused the new X); and a late output
    of the aborted X (from a step in flight) reached the new X as its first token."""
    llm, loop = engine

    async def run():
        for _ in range(3):
            state = await llm.add_request("a prompt", LONG, "reused")
            await _bounded(state.queue.get())  # it is running in the engine
            llm.abort_nowait("reused")
            token_ids, finish = await _bounded(_collect(llm, "reused"))
            assert len(token_ids) == 4 and finish == "length"
        assert not llm.errored and llm.num_unfinished == 0

    loop.run_until_complete(run())


def _assert_dies_cleanly(llm: AsyncLLM, breaker, match: str) -> None:
    async def run():
        pending = asyncio.ensure_future(_collect(llm, "pending", LONG))
        await asyncio.sleep(0.5)
        breaker()
        with pytest.raises(EngineDeadError, match=match):
            await _bounded(pending, 10)
        assert llm.errored and match in llm.dead_error
        with pytest.raises(EngineDeadError):
            await _bounded(_collect(llm, "new"), 10)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(run())
    finally:
        llm.shutdown()
        loop.run_until_complete(asyncio.sleep(0.1))
        loop.close()


def _slow_engine(model_dir: str, monkeypatch) -> AsyncLLM:
    """20 ms a step: the pending 500-token request is still running when the test breaks the
    engine (on a fast model it could finish first, and nothing would arrive to break on)."""
    monkeypatch.setenv("VSERVE_FAULT_INJECT", "execute_model_delay:20")
    return _engine(model_dir)


def test_failing_stats_listener_marks_the_engine_dead(tiny_model_dir, monkeypatch):
    """A listener that raises ends the output handler: the engine is then marked dead, so
    every request fails at once instead of hanging."""
    llm = _slow_engine(tiny_model_dir("llama"), monkeypatch)

    def broken(stats, engine):
        raise RuntimeError("listener bug")

    _assert_dies_cleanly(llm, lambda: llm.stats_listeners.append(broken), "listener bug")


def test_failing_socket_reader_marks_the_engine_dead(tiny_model_dir, monkeypatch):
    llm = _slow_engine(tiny_model_dir("llama"), monkeypatch)

    def broken(frames):
        raise ValueError("reader bug")

    _assert_dies_cleanly(llm, lambda: setattr(llm.client, "_decode", broken), "reader bug")
