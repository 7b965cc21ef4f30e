"""Scheduler tests with a fake runner: invariants after every schedule and commit.

Numbers in the test names (`test_sN_...`) number the scenarios of async scheduling each test
walks through: admission, chunking, commits in flight, aborts, preemption and stale outputs.
"""

import random

import pytest

from tests.support.fakes import (
    EOS,
    Driver,
    FakeRunner,
    expected_tokens,
    make_request,
    make_scheduler,
    random_prompt,
)
from vserve.core.request import Request, RequestStatus
from vserve.sampling_params import SamplingParams

DEPTHS = [1, 2, 3]


def _run_all(driver, reqs):
    for r in reqs:
        driver.add(r)
    driver.run()


@pytest.mark.parametrize("depth", DEPTHS)
def test_plain_batch_matches_expected(depth):
    rng = random.Random(0)
    sched = make_scheduler(async_scheduling=depth > 1)
    driver = Driver(sched, depth=depth)
    prompts = {f"r{i}": random_prompt(rng, rng.randint(1, 20)) for i in range(6)}
    _run_all(driver, [make_request(k, p, max_tokens=7) for k, p in prompts.items()])
    for k, p in prompts.items():
        assert driver.outputs[k] == expected_tokens(p, 7)
        assert driver.finish[k] == "length"
    assert sched.kv.pool.num_used_blocks == 0
    assert not driver.emitted_after_finish


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_s1_no_wasted_steps_at_depth_2(max_tokens):
    sched = make_scheduler(async_scheduling=True)
    driver = Driver(sched, depth=2)
    prompts = {"a": list(range(1, 7)), "b": list(range(10, 15))}
    driver.add(make_request("a", prompts["a"], max_tokens=max_tokens))
    driver.step()  # admit "a" one step before "b"
    driver.add(make_request("b", prompts["b"], max_tokens=max_tokens))
    driver.run()
    for k, p in prompts.items():
        assert len(driver.outputs[k]) == max_tokens
        assert driver.outputs[k] == expected_tokens(p, max_tokens)
    total = sum(so.total_num_scheduled_tokens for so in driver.runner.steps)
    assert total == sum(len(p) + max_tokens - 1 for p in prompts.values())


def test_s2_max_tokens_1_launches_no_decode():
    sched = make_scheduler(async_scheduling=True)
    driver = Driver(sched, depth=2)
    _run_all(driver, [make_request("a", [1, 2, 3, 4], max_tokens=1)])
    scheduled = [so.num_scheduled_tokens.get("a") for so in driver.runner.steps]
    assert [n for n in scheduled if n] == [4]


def test_s3_abort_running_requests_in_flight():
    rng = random.Random(3)
    sched = make_scheduler(num_blocks=256, max_num_seqs=16, async_scheduling=True)
    driver = Driver(sched, depth=2)
    ids = [f"r{i}" for i in range(10)]
    for i in ids:
        driver.add(make_request(i, random_prompt(rng, 5), max_tokens=100))
    order = ids[:]
    rng.shuffle(order)
    for _ in range(4):
        driver.step()
    committed_at_abort = {}
    for victim in order:
        driver.step()
        driver.step()
        committed_at_abort[victim] = len(driver.outputs[victim])
        sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        sched.check_invariants()
    sched.finish_requests(["unknown", order[0]], RequestStatus.FINISHED_ABORTED)  # no-ops
    driver.run()
    for victim in order:
        assert len(driver.outputs[victim]) == committed_at_abort[victim]
        assert victim not in driver.finish  # aborts emit nothing from the engine
    assert sched.kv.pool.num_used_blocks == 0
    assert not sched.has_unfinished_requests()


def test_s4_abort_waiting_and_mid_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=1, async_scheduling=True)
    driver = Driver(sched, depth=2)
    driver.add(make_request("chunked", list(range(40)), max_tokens=4))
    driver.add(make_request("queued", list(range(5)), max_tokens=4))
    driver.step()
    driver.step()
    chunked = sched.requests["chunked"]
    assert 0 < chunked.num_computed_tokens < chunked.num_prompt_tokens
    assert sched.requests["queued"].status == RequestStatus.WAITING
    sched.finish_requests(["chunked", "queued"], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    driver.run()
    assert driver.outputs["chunked"] == [] and driver.outputs["queued"] == []
    assert sched.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("depth", DEPTHS)
def test_s5_eos_while_next_step_in_flight(depth):
    runner = FakeRunner(eos_after={"a": 3})
    sched = make_scheduler(async_scheduling=depth > 1)
    driver = Driver(sched, runner, depth=depth)
    prompt = [5, 6, 7]
    _run_all(driver, [make_request("a", prompt, max_tokens=50)])
    assert driver.outputs["a"] == expected_tokens(prompt, 50, eos_after=3)
    assert driver.outputs["a"][-1] == EOS and driver.finish["a"] == "stop"
    assert driver.emitted_after_finish == []
    finished_steps = [so for so in runner.steps if "a" in so.finished_req_ids]
    assert len(finished_steps) == 1  # freed exactly once; the workers hear of it once
    if depth > 1:  # the step after EOS was in flight and its token was dropped
        assert sum("a" in so.sampling_req_ids for so in runner.steps) > 4


def test_s6_stop_token_and_min_tokens():
    runner = FakeRunner(eos_after={"a": 1, "b": 1})
    sched = make_scheduler(async_scheduling=True)
    driver = Driver(sched, runner, depth=2)
    driver.add(make_request("a", [1, 2], max_tokens=10, min_tokens=3))
    driver.add(make_request("b", [1, 2], max_tokens=10, eos=(), stop_token_ids=[EOS]))
    driver.run()
    # the fake runner does not mask, so EOS arrives early; the scheduler must not stop on it
    # before min_tokens outputs
    assert len(driver.outputs["a"]) == 4 and driver.finish["a"] == "stop"
    assert len(driver.outputs["b"]) == 2 and driver.outputs["b"][-1] == EOS
    assert driver.stop_reasons["b"] == EOS and driver.finish["b"] == "stop"


@pytest.mark.parametrize("depth", DEPTHS)
def test_s7_max_model_len(depth):
    sched = make_scheduler(max_model_len=12, async_scheduling=depth > 1)
    driver = Driver(sched, depth=depth)
    prompt = list(range(1, 9))
    _run_all(driver, [make_request("a", prompt, max_tokens=100)])
    assert driver.outputs["a"] == expected_tokens(prompt, 100, max_model_len=12)
    assert len(prompt) + len(driver.outputs["a"]) == 12
    assert driver.finish["a"] == "length"
    positions = sum(so.num_scheduled_tokens.get("a", 0) for so in driver.runner.steps)
    assert positions == 11  # never a step for a position at or past max_model_len - 1


def _cuts_a_prompt(so, runner) -> bool:
    """Whether the step scheduled fewer of a request's prompt tokens than remained."""
    for new in so.scheduled_new_reqs:
        if new.num_computed_tokens + so.num_scheduled_tokens[new.req_id] < new.num_prompt_tokens:
            return True
    cached = so.scheduled_cached_reqs
    for req_id, num_before in zip(cached.req_ids, cached.num_computed_tokens):
        if num_before + so.num_scheduled_tokens[req_id] < runner.reqs[req_id].num_prompt:
            return True
    return False


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("seed", range(6))
def test_s8_randomized_arrivals_preemption_chunking_aborts(depth, seed):
    rng = random.Random(seed)
    num_blocks, max_num_seqs = rng.choice([10, 16, 40]), rng.choice([2, 4, 8])
    max_num_batched_tokens = rng.choice([5, 16, 64])
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=40,
        async_scheduling=depth > 1,
        prefix_caching=rng.random() < 0.7,
    )
    driver = Driver(sched, depth=depth)
    shared = random_prompt(rng, 12)
    pending = []
    for i in range(24):
        prompt = (shared[: rng.randint(0, 12)] if rng.random() < 0.5 else []) + random_prompt(
            rng, rng.randint(1, 14)
        )
        pending.append(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 12)))
    specs = {r.request_id: (list(r.prompt_token_ids), r.max_tokens) for r in pending}
    aborted = set()
    chunked_steps = []
    execute = driver.runner.execute

    def spy(so):
        ro = execute(so)
        if _cuts_a_prompt(so, driver.runner):
            chunked_steps.append(so.step_id)
        return ro

    driver.runner.execute = spy

    def on_step(i, drv):
        if pending and rng.random() < 0.5:
            drv.add(pending.pop(0))
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
            sched.check_invariants()

    driver.add(pending.pop(0))
    driver.run(on_step=on_step)
    while pending:
        driver.add(pending.pop(0))
        driver.run()
    assert not driver.emitted_after_finish
    assert sorted(driver.outputs) == sorted(specs)
    for req_id, (prompt, max_tokens) in specs.items():
        expected = expected_tokens(prompt, max_tokens, max_model_len=40)
        tokens = driver.outputs[req_id]
        if req_id in aborted:
            assert tokens == expected[: len(tokens)], req_id
        else:
            assert tokens == expected, req_id
            assert req_id in driver.finish
    assert sched.kv.pool.num_used_blocks == 0
    # 10 blocks hold one 40-token request; 4 or 8 sequences outgrow them at every seed here
    if num_blocks == 10 and max_num_seqs >= 4:
        assert sched.num_preemptions > 0
    if max_num_batched_tokens == 5:  # prompts run to 26 tokens
        assert chunked_steps


@pytest.mark.parametrize("depth", DEPTHS)
def test_s9_preemption_with_steps_in_flight_matches_plain_run(depth):
    rng = random.Random(9)
    prompts = {f"r{i}": random_prompt(rng, rng.randint(6, 14)) for i in range(6)}
    tight = make_scheduler(
        num_blocks=12, block_size=4, max_model_len=40, async_scheduling=depth > 1
    )
    driver = Driver(tight, depth=depth)
    _run_all(driver, [make_request(k, p, max_tokens=20) for k, p in prompts.items()])
    assert tight.num_preemptions > 0
    for k, p in prompts.items():
        assert driver.outputs[k] == expected_tokens(p, 20), k


def test_s14_chunked_prefill_placeholders():
    sched = make_scheduler(max_num_batched_tokens=8, async_scheduling=True)
    driver = Driver(sched, depth=2)
    driver.add(make_request("a", list(range(20)), max_tokens=3))
    req = sched.requests["a"]
    seen = []
    while sched.has_requests() or driver.queue:
        before = len(driver.runner.steps)
        driver.step()
        if len(driver.runner.steps) > before and req.status == RequestStatus.RUNNING:
            so = driver.runner.steps[-1]
            seen.append(
                (
                    so.num_scheduled_tokens.get("a"),
                    "a" in so.sampling_req_ids,
                    req.num_output_placeholders,
                )
            )
    # chunks of 8, 8, then the final 4 reserves one placeholder; decode follows next step
    assert seen[0] == (8, False, 0) and seen[1] == (8, False, 0)
    assert seen[2][:2] == (4, True)
    assert seen[3][:2] == (1, True)
    assert driver.outputs["a"] == expected_tokens(list(range(20)), 3)


def test_s15_prefix_cache_same_step_dedupe_and_follow_up():
    sched = make_scheduler(block_size=4, async_scheduling=True)
    driver = Driver(sched, depth=2)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    driver.add(make_request("a", prompt, max_tokens=4))
    driver.add(make_request("b", prompt, max_tokens=4))
    driver.step()
    first = driver.runner.steps[0]
    assert first.num_scheduled_tokens == {"a": 10, "b": 2}  # b hits a's two full blocks
    driver.run()
    assert driver.outputs["a"] == driver.outputs["b"] == expected_tokens(prompt, 4)
    # multi-turn: prompt + answer + new text hits every settled full block
    follow = prompt + driver.outputs["a"] + [77, 78, 79]
    driver.add(make_request("c", follow, max_tokens=2))
    driver.step()
    step = driver.runner.steps[-1]
    assert step.num_scheduled_tokens["c"] == len(follow) - 12
    driver.run()


def test_prefix_cache_only_caches_settled_tokens():
    """Settled (kv_cache_manager): positions sent to a step whose ids are known -- the prompt
    and the outputs the driver has received. A step in flight has a placeholder at the
    position after its input, which must never reach a cached block."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6, async_scheduling=True)
    runner = FakeRunner()
    driver = Driver(sched, runner, depth=2)
    prompt = random_prompt(random.Random(14), 20)
    driver.add(make_request("a", prompt, max_tokens=12))
    num_sent, clamped = 0, []

    def check_cached_blocks():
        num_known = len(prompt) + len(driver.outputs["a"])
        settled = min(num_sent, num_known)
        assert sched.kv.num_cached_blocks.get("a", 0) == settled // 4, (num_sent, num_known)
        clamped.append(settled // 4 < num_sent // 4)

    execute = runner.execute

    def spy(so):  # after each schedule, before any commit of the driver's step
        nonlocal num_sent
        if "a" in so.num_scheduled_tokens:
            num_sent += so.num_scheduled_tokens["a"]
            check_cached_blocks()
        return execute(so)

    runner.execute = spy
    while "a" in sched.requests:
        driver.step()
        if "a" in sched.requests:
            check_cached_blocks()
    chunks = [so.num_scheduled_tokens["a"] for so in runner.steps[:4]]
    assert chunks == [6, 6, 6, 2]  # prefill in chunks, the next sent before one returns
    assert any(clamped)  # counting sent positions would have cached a placeholder's block
    driver.run()
    assert driver.outputs["a"] == expected_tokens(prompt, 12)


def test_n_siblings_share_prompt_blocks_without_prefix_caching():
    sched = make_scheduler(block_size=4, async_scheduling=True, prefix_caching=False)
    driver = Driver(sched, depth=2)
    prompt = list(range(1, 14))
    for i in range(3):
        sp = SamplingParams(max_tokens=3, temperature=1.0, seed=i)
        driver.add(Request(f"p-{i}", list(prompt), sp, eos_token_ids=(EOS,), cache_salt="p"))
    driver.add(make_request("other", prompt, max_tokens=3))
    driver.step()
    first = driver.runner.steps[0]
    assert first.num_scheduled_tokens["p-0"] == 13
    assert first.num_scheduled_tokens["p-1"] == first.num_scheduled_tokens["p-2"] == 1
    assert first.num_scheduled_tokens["other"] == 13  # no cache outside the sibling group
    driver.run()


@pytest.mark.parametrize("depth", [2, 3])
def test_request_sits_in_consecutive_inflight_steps(depth):
    sched = make_scheduler(async_scheduling=True)
    runner = FakeRunner()
    driver = Driver(sched, runner, depth=depth)
    driver.add(make_request("a", [1, 2, 3], max_tokens=10))
    placeholders = []
    execute = runner.execute

    def spy(so):
        if "a" in sched.requests:
            placeholders.append(sched.requests["a"].num_output_placeholders)
        return execute(so)

    runner.execute = spy
    driver.run()
    assert max(placeholders) == depth
    assert driver.outputs["a"] == expected_tokens([1, 2, 3], 10)


def test_sync_pp_never_schedules_inflight_request():
    sched = make_scheduler(async_scheduling=False)
    driver = Driver(sched, depth=2)
    driver.add(make_request("a", [1, 2, 3], max_tokens=5))
    driver.add(make_request("b", [4, 5, 6], max_tokens=5))
    driver.run()
    inflight_max = 0
    for i, so in enumerate(driver.runner.steps[1:], 1):
        inflight_max = max(
            inflight_max,
            len(set(so.num_scheduled_tokens) & set(driver.runner.steps[i - 1].sampling_req_ids)),
        )
    assert inflight_max == 0
    assert driver.outputs["a"] == expected_tokens([1, 2, 3], 5)


def test_request_id_reuse_after_finish_is_not_confused_with_stale_output():
    sched = make_scheduler(async_scheduling=True)
    runner = FakeRunner(eos_after={"a": 2})
    driver = Driver(sched, runner, depth=2)
    driver.add(make_request("a", [1, 2, 3], max_tokens=10))
    while "a" not in driver.finish:
        driver.step()
    assert driver.queue  # the step after EOS is still in flight
    runner.eos_after = {}
    driver.outputs["a"] = []
    del driver.finish["a"]
    driver.add(make_request("a", [7, 8, 9], max_tokens=3))
    driver.run()
    assert driver.outputs["a"] == expected_tokens([7, 8, 9], 3)


def test_kv_too_small_for_waiting_request_waits_then_runs():
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, async_scheduling=True)
    driver = Driver(sched, depth=2)
    _run_all(
        driver,
        [
            make_request("a", list(range(16)), max_tokens=6),
            make_request("b", list(range(20, 36)), max_tokens=6),
        ],
    )
    assert driver.outputs["a"] == expected_tokens(list(range(16)), 6)
    assert driver.outputs["b"] == expected_tokens(list(range(20, 36)), 6)
