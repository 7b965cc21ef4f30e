"""The grammar compile budget and the compile jobs: a constraint that would compile for too long
or in too much memory fails only the requests waiting for it (the compile worker is killed,
the engine's own process never compiles it); every request of one constraint shares one
compile; a compile nobody waits for any more stops; cached grammars never wait behind a job.

The heavy constraints are regexes of thousands of alternatives against the embedded model's
262k-token vocabulary: each one costs seconds and hundreds of MB to compile."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from vserve.config import StructuredOutputConfig
from vserve.core.outputs import ERROR_BUSY, ERROR_INVALID, RequestError
from vserve.engine.grammars import BytesLRU
from vserve.engine.structured_output import StructuredOutputManager
from vserve.sampling_params import StructuredOutputsParams

HEAVY = "(a|b)" * 8000  # about 10 s and 190 MB to compile here
LIGHT = "(yes|no)"


def _regex(source: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=source)


def _error(future: Future, timeout: float = 120) -> RequestError:
    with pytest.raises(RequestError) as info:
        future.result(timeout)
    return info.value


@pytest.fixture(scope="module")
def embedded_tokenizer():
    """The embedded model's folder; its xgrammar tokenizer info (a tokenizer load and a pass
    over 262k tokens: seconds) is made once for the module's managers, not once by each."""
    from vserve.models.resolve import resolve_model_path

    made = {}
    original = StructuredOutputManager._tokenizer_info

    def info(manager):
        key = (manager.tokenizer_path, manager.vocab_size, tuple(manager.eos_token_ids))
        if key not in made:
            made[key] = original(manager)
        return made[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StructuredOutputManager, "_tokenizer_info", info)
        yield resolve_model_path(None)


def _manager(path: str, **config) -> StructuredOutputManager:
    return StructuredOutputManager(path, 262144, (1,), StructuredOutputConfig(**config))


@pytest.mark.slow
def test_deadline_fails_only_its_requests(embedded_tokenizer):
    manager = _manager(embedded_tokenizer, compile_timeout=1.0)
    try:
        heavy = manager.submit(_regex(HEAVY))
        also_heavy = manager.submit(_regex(HEAVY))  # the same constraint: one job
        light = manager.submit(_regex(LIGHT))
        assert also_heavy is heavy
        error = _error(heavy)
        assert error.kind == ERROR_INVALID
        assert "within 1 s" in str(error) and "--grammar-compile-timeout" in str(error)
        assert light.result(120) is not None  # the next job compiles in a new worker
        assert manager._worker is not None and manager._worker.num_started == 2
    finally:
        manager.shutdown()


@pytest.mark.slow
def test_memory_budget_fails_only_its_requests(embedded_tokenizer):
    manager = _manager(embedded_tokenizer, compile_timeout=120, compile_memory_mb=64)
    try:
        error = _error(manager.submit(_regex(HEAVY)))
        assert error.kind == ERROR_INVALID
        assert "64 MiB" in str(error) and "--grammar-compile-memory-mb" in str(error)
        assert manager.submit(_regex(LIGHT)).result(120) is not None
    finally:
        manager.shutdown()


@pytest.mark.slow
def test_released_compiles_stop_and_cached_grammars_do_not_wait(embedded_tokenizer):
    manager = _manager(embedded_tokenizer, compile_timeout=120)
    try:
        first = manager.submit(_regex(LIGHT))
        first.result(120)  # compiled once: cached from now on
        heavy = manager.submit(_regex(HEAVY))
        queued = manager.submit(_regex(HEAVY + "c"))
        time.sleep(0.5)  # the heavy trial is under way in the worker
        started = time.monotonic()
        cached = manager.submit(_regex(LIGHT))
        assert cached.done() and cached.result() is first.result()
        manager.release(queued)  # waited in the queue: cancelled, never compiled
        assert queued.cancelled()
        manager.release(heavy)  # in its trial: the worker is killed
        with pytest.raises(BaseException):  # noqa: B017 -- cancelled or failed, not compiled
            heavy.result(60)
        assert time.monotonic() - started < 30  # well before the heavy compile could end
        assert not manager._jobs
    finally:
        manager.shutdown()


def test_too_many_compiles_waiting_is_busy(monkeypatch):
    manager = _manager("unused")
    monkeypatch.setattr(manager, "_start", lambda: None)  # no job ever runs
    futures = [
        manager.submit(_regex(f"x{i}")) for i in range(StructuredOutputManager.MAX_PENDING_COMPILES)
    ]
    assert not any(f.done() for f in futures)
    busy = manager.submit(_regex("one more"))
    assert _error(busy, timeout=1).kind == ERROR_BUSY
    assert manager.submit(_regex("x0")) is futures[0]  # joining a waiting job is no new one
    for future in futures:
        manager.release(future)
    assert all(f.cancelled() for f in futures[1:]) and not futures[0].cancelled()
    manager.release(futures[0])
    assert futures[0].cancelled() and not manager._jobs


def test_bytes_lru_bounded_by_bytes():
    cache = BytesLRU(100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    cache.get("a")  # a is now the most recently used
    cache.put("c", "C", 40)
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.num_bytes == 80
    cache.put("huge", "H", 101)  # larger than the whole cache: not kept
    assert cache.get("huge") is None and len(cache) == 2


def test_waiters_share_one_release_count():
    """A job stays while any of its requests waits: releasing one of two keeps it."""
    manager = _manager("unused")
    manager._start = lambda: None  # type: ignore[method-assign]
    a = manager.submit(_regex("shared"))
    b = manager.submit(_regex("shared"))
    manager.release(a)
    assert not b.cancelled() and manager._jobs
    manager.release(b)
    assert b.cancelled() and not manager._jobs


def test_a_prompts_children_carry_their_constraint_and_prompt_once():
    """The n children of one prompt go in one ADD frame whose constraint and prompt ids cross
    once; after decoding, every child holds the same constraint object and its prompt."""
    import msgspec

    from vserve.engine.messages import (
        EngineCoreRequest,
        EngineCoreRequests,
        pack_requests,
        unpack_requests,
    )
    from vserve.sampling_params import SamplingParams

    constraint = _regex("x" * 100_000)
    params = SamplingParams(n=1, temperature=1, structured_outputs=constraint)
    prompt = list(range(5, 20_005))
    children = [EngineCoreRequest(f"{i}_r", prompt, params, [2], i) for i in range(64)]
    payload = msgspec.msgpack.encode(pack_requests(children))
    assert len(payload) < 2 * (100_000 + 3 * 20_000)  # each once, not 64 times
    assert params.structured_outputs is constraint  # the caller's params are left alone
    decoded = unpack_requests(msgspec.msgpack.decode(payload, type=EngineCoreRequests))
    assert [r.request_id for r in decoded] == [r.request_id for r in children]
    shared = decoded[0].sampling_params.structured_outputs
    assert shared == constraint
    assert all(r.sampling_params.structured_outputs is shared for r in decoded)
    assert all(r.prompt_token_ids == prompt for r in decoded)


@pytest.mark.slow
def test_a_retry_after_an_abandoned_compile_starts_afresh(embedded_tokenizer):
    """A client that gives up on a slow compile and sends the same constraint again gets a
    job of its own (which runs to its verdict), not the cancelled one."""
    manager = _manager(embedded_tokenizer, compile_timeout=2.0)
    try:
        manager.submit(_regex(LIGHT)).result(120)  # the worker is up
        first = manager.submit(_regex(HEAVY))
        time.sleep(0.3)  # in its trial
        manager.release(first)
        retry = manager.submit(_regex(HEAVY))
        assert retry is not first
        error = _error(retry)
        assert error.kind == ERROR_INVALID and "--grammar-compile-timeout" in str(error)
    finally:
        manager.shutdown()


@pytest.mark.slow
def test_grammars_held_by_requests_are_bounded(embedded_tokenizer):
    """Compiled grammars that requests hold count against a bound; a new one past it is
    'busy' (a retry may succeed), and what requests release no longer counts."""
    manager = _manager(embedded_tokenizer)
    try:
        held = manager.submit(_regex("(aaa|bbb)"))
        held.result(120)
        assert manager._live.num_bytes > 0
        manager._live_limit = manager._live.num_bytes  # room for one such grammar
        assert _error(manager.submit(_regex("(ccc|ddd)"))).kind == ERROR_BUSY
        manager.release(held)
        assert manager._live.num_bytes == 0
        assert manager.submit(_regex("(eee|fff)")).result(120) is not None
    finally:
        manager.shutdown()


@pytest.mark.slow
def test_a_worker_started_ahead_is_the_one_used_and_closes_unused(tiny_model_dir):
    """The worker process starts before the engine core builds its own compiler (their
    imports overlap): the first compile runs in that process, and a handle closed before any
    compile leaves no process behind."""
    import xgrammar as xgr

    from vserve.engine import grammar_worker
    from vserve.engine.grammar_worker import CompileWorker, Job
    from vserve.tokenizer import load_tokenizer

    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(tiny_model_dir("llama")))
    started = grammar_worker.spawn()
    worker = CompileWorker(info.serialize_json(), 256, started)
    try:
        assert worker.check(Job("regex", LIGHT), 60).ok
        assert worker._proc is started and worker.num_started == 1
    finally:
        worker.close()
    assert started.poll() is not None
    unused = grammar_worker.spawn()
    CompileWorker(info.serialize_json(), 256, unused).close()
    assert unused.poll() is not None
