"""The engine core's idle-time KV invariant (VSERVE_DEBUG_INVARIANTS, on in tests): when the
last request finishes, every block is free; a leaked block is reported loudly."""

import pytest

from tests.support.engines import make_llm
from tests.support.fakes import FakeExecutor, core_request, fake_engine_config
from tests.support.hf_reference import PROMPTS
from vserve import SamplingParams
from vserve.engine.core import EngineCore


def _core(async_on=True):
    return EngineCore(fake_engine_config(async_scheduling=async_on), FakeExecutor())


def _drain(core, max_calls=1000):
    for _ in range(max_calls):
        if not core.has_work():
            return
        core.step_fn()
    raise AssertionError("engine did not drain")


def test_debug_invariants_are_on_in_tests():
    assert _core().debug_invariants


@pytest.mark.parametrize("async_on", [False, True])
def test_clean_run_passes_the_idle_check(async_on):
    core = _core(async_on)
    for i in range(3):
        core.add_request(core_request(f"r{i}", list(range(1, 20 + i)), max_tokens=5))
    _drain(core)
    assert core.scheduler.kv.pool.num_used_blocks == 0
    core.check_idle_invariants()  # explicitly too: idle and clean


@pytest.mark.parametrize("async_on", [False, True])
def test_leaked_block_trips_the_idle_check(async_on):
    core = _core(async_on)
    core.add_request(core_request("a", [1, 2, 3, 4, 5], max_tokens=4))
    assert core.has_work()
    core.step_fn()
    core.scheduler.kv.pool.get_new_blocks(1)  # held by no request: a leak
    with pytest.raises(RuntimeError, match="1 KV blocks in use at idle"):
        _drain(core)


def test_the_check_is_off_without_the_flag(monkeypatch):
    monkeypatch.setenv("VSERVE_DEBUG_INVARIANTS", "0")
    core = _core()
    assert not core.debug_invariants
    core.add_request(core_request("a", [1, 2, 3], max_tokens=2))
    core.step_fn()
    core.scheduler.kv.pool.get_new_blocks(1)
    _drain(core)  # no check: the leak goes unnoticed, as in production
    with pytest.raises(RuntimeError, match="in use at idle"):
        core.check_idle_invariants()


@pytest.mark.parametrize("async_on", [False, True])
def test_a_stop_string_on_the_last_request_frees_it_at_once(tiny_model_dir, async_on):
    """A stop string ends a request in the front end, which aborts it in the core. In process
    the abort applies at once: when that request was the last, `generate` returns with no
    request left in the scheduler and no KV block held (it used to wait for a next step)."""
    llm = make_llm(tiny_model_dir("qwen3"), max_model_len=128, async_scheduling=async_on)
    try:
        base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        text = llm.generate(PROMPTS[3], base, use_tqdm=False)[0].outputs[0].text
        stop = text[5:8]
        out = llm.generate(PROMPTS[3], base.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        core = llm.engine.client.core
        assert not core.scheduler.requests
        assert core.scheduler.kv.pool.num_used_blocks == 0
    finally:
        llm.shutdown()
