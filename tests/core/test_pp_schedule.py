"""Pipeline-parallel scheduling with a fake runner: every stage busy at once.

Under PP a step's rows may only read a token that stage 0 already has: one sampled at least
`pp` steps earlier (the last stage finished that step while stage 0 ran the steps between).
Decoding requests therefore form `pp` disjoint groups that take turns, and the engine keeps
`pp + 1` steps in flight (async) so the next group's step is ready when stage 0 is free.
"""

import random

import pytest

from tests.support.fakes import (
    Driver,
    FakeExecutor,
    FakeRunner,
    core_request,
    expected_tokens,
    fake_engine_config,
    make_request,
    make_scheduler,
    random_prompt,
)
from vserve.core.request import RequestStatus
from vserve.engine.core import EngineCore


class CadenceSpy:
    """Wraps FakeRunner.execute: for every step, which rows read a token not yet on the host
    (an in-flight placeholder) and how many steps back that token was sampled."""

    def __init__(self, sched, runner: FakeRunner) -> None:
        self.sched, self.runner = sched, runner
        self.last_sampled: dict[tuple[str, int], int] = {}  # (req, epoch) -> step id
        self.gaps: list[int] = []  # steps back, per fed-back row
        self.decodes: list[int] = []  # decode rows per step
        self.execute = runner.execute
        runner.execute = self

    def __call__(self, so):
        cached = so.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens))
        num_decodes = 0
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            key = (req_id, so.req_epochs[req_id])
            if req_id in before and before[req_id] + n > req.num_tokens:
                self.gaps.append(so.step_id - self.last_sampled[key])  # fed back
            num_decodes += req_id in before and n == 1
        for req_id in so.sampling_req_ids:
            self.last_sampled[(req_id, so.req_epochs[req_id])] = so.step_id
        self.decodes.append(num_decodes)
        return self.execute(so)


def _driver(pp: int, async_on: bool, **cfg):
    sched = make_scheduler(async_scheduling=async_on, pp=pp, **cfg)
    runner = FakeRunner()
    spy = CadenceSpy(sched, runner)
    return sched, Driver(sched, runner, depth=pp + 1 if async_on else pp), spy


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_fed_back_tokens_are_pp_steps_old(pp, seed):
    """Arrivals, chunked prefill, preemption by a small KV cache and aborts: no row ever
    reads a token sampled fewer than pp steps before, and every request finishes with the
    tokens of a plain run."""
    rng = random.Random(seed)
    sched, driver, spy = _driver(
        pp,
        True,
        num_blocks=rng.choice([16, 40]),
        max_num_seqs=rng.choice([4, 8]),
        max_num_batched_tokens=rng.choice([16, 64]),
        max_model_len=40,
    )
    pending = [
        make_request(f"r{i}", random_prompt(rng, rng.randint(1, 14)), max_tokens=rng.randint(1, 12))
        for i in range(16)
    ]
    prompts = {r.request_id: list(r.prompt_token_ids) for r in pending}
    max_tokens = {r.request_id: r.max_tokens for r in pending}
    aborted = set()

    def on_step(i, drv):
        if pending and rng.random() < 0.5:
            drv.add(pending.pop(0))
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)

    driver.add(pending.pop(0))
    driver.run(on_step=on_step)
    while pending:
        driver.add(pending.pop(0))
        driver.run()
    assert spy.gaps and min(spy.gaps) >= pp
    for req_id, prompt in prompts.items():
        if req_id not in aborted:
            assert driver.outputs[req_id] == expected_tokens(
                prompt, max_tokens[req_id], max_model_len=40
            ), req_id
    assert sched.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("async_on", [True, False])
def test_groups_take_turns_without_empty_steps(pp, async_on):
    """Eight requests admitted in one step split into pp even groups: once decoding, every
    step carries one group (no step idles a stage, none carries two groups)."""
    sched, driver, spy = _driver(pp, async_on, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(8):
        driver.add(make_request(f"r{i}", [i + 1, i + 2, i + 3], max_tokens=30))
    driver.run()
    assert len(driver.runner.steps[0].num_scheduled_tokens) == 8  # one admission step
    steady = spy.decodes[2 * pp : 10 * pp]  # all eight still decoding (30 tokens each)
    assert min(steady) >= 8 // pp and max(steady) <= -(-8 // pp), spy.decodes
    if async_on:
        assert min(spy.gaps) >= pp
    assert all(len(out) == 30 for out in driver.outputs.values())


def test_pp1_puts_every_request_in_every_step():
    """PP=1 still puts every request in every step (async): the cadence is PP-only."""
    sched, driver, spy = _driver(1, True)
    for i in range(4):
        driver.add(make_request(f"r{i}", [i + 1, i + 2], max_tokens=6))
    driver.run()
    assert max(spy.decodes) == 4 and min(spy.gaps) == 1


@pytest.mark.parametrize("pp", [2, 3])
def test_engine_keeps_pp_plus_one_steps_in_flight(pp):
    core = EngineCore(fake_engine_config(async_scheduling=True, pp=pp), FakeExecutor())
    assert core.depth == pp + 1
    prompts = {f"r{i}": list(range(i + 1, i + 6)) for i in range(2 * pp)}
    for k, p in prompts.items():
        core.add_request(core_request(k, p, max_tokens=8))
    outs = {}
    while core.has_work():
        for o in core.step_fn() or []:
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert len(core.batch_queue) <= core.depth
    ex = core.executor
    assert ex.max_in_flight == pp + 1
    assert ex.resolve_order == ex.launched
    assert outs == {k: expected_tokens(p, 8) for k, p in prompts.items()}
