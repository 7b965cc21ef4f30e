"""Embeddings in the scheduler, with the fake runner (whose hidden state at a position is
[token, position, 1]): the chunks' pooled sums add up to the prompt's mean or its last row,
through chunked prefill, prefix-cache hits (which "mean" never takes), steps in flight and
preemption, which starts a request's sums again; a request that misses a position fails
instead of returning a wrong vector."""

import random

import numpy as np
import pytest

from tests.support.fakes import Driver, fake_hidden, make_request, make_scheduler, random_prompt

DEPTHS = [1, 2, 3]


def _expected(prompt: list[int], pooling: str) -> np.ndarray:
    rows = np.array([fake_hidden(prompt, p) for p in range(len(prompt))])
    return rows[-1] if pooling == "last" else rows.mean(0)


@pytest.mark.parametrize("depth", DEPTHS)
def test_pooled_vectors_survive_chunks_hits_and_preemption(depth):
    rng = random.Random(3)
    shared = random_prompt(rng, 16)
    sched = make_scheduler(
        num_blocks=14,
        block_size=4,
        max_num_batched_tokens=8,
        max_model_len=48,
        async_scheduling=depth > 1,
    )
    driver = Driver(sched, depth=depth)
    prompts, reqs = {}, []
    for i in range(8):
        prompt = shared + random_prompt(rng, rng.randint(4, 20))
        if i % 2:  # generation beside them, to fill the KV cache
            reqs.append(make_request(f"g{i}", prompt, max_tokens=20))
            continue
        pooling = "mean" if i % 4 == 0 else "last"
        prompts[f"e{i}"] = (prompt, pooling)
        reqs.append(make_request(f"e{i}", prompt, max_tokens=1, pooling=pooling))
    for r in reqs:
        driver.add(r)
    driver.run()
    preempted = set().union(*(so.preempted_req_ids for so in driver.runner.steps))
    assert preempted & set(prompts), preempted  # an embedding was computed again
    for req_id, (prompt, pooling) in prompts.items():
        assert driver.finish[req_id] == "length", req_id
        got = np.frombuffer(driver.embeddings[req_id], dtype="<f4")
        np.testing.assert_allclose(got, _expected(prompt, pooling), rtol=1e-6, err_msg=req_id)
    assert sched.kv.pool.num_used_blocks == 0


def test_mean_pooling_takes_no_prefix_hit_and_last_does():
    sched = make_scheduler(max_num_batched_tokens=64)
    driver = Driver(sched, depth=1)
    prompt = list(range(3, 23))
    driver.add(make_request("warm", prompt, max_tokens=1))
    driver.run()
    for pooling in ("mean", "last"):
        driver.add(make_request(pooling, prompt, max_tokens=1, pooling=pooling))
        driver.run()
        new = next(
            n for so in driver.runner.steps for n in so.scheduled_new_reqs if n.req_id == pooling
        )
        assert (new.num_computed_tokens > 0) == (pooling == "last"), pooling
        got = np.frombuffer(driver.embeddings[pooling], dtype="<f4")
        np.testing.assert_allclose(got, _expected(prompt, pooling), rtol=1e-6)


def test_a_missing_position_fails_the_request():
    """A chunk's sum that never arrived (a worker that pooled nothing) is an error, not a
    vector of the positions that did."""
    sched = make_scheduler(max_num_batched_tokens=8)
    driver = Driver(sched, depth=1)
    execute, dropped = driver.runner.execute, []

    def drop_first_chunk(so):
        ro = execute(so)
        if not dropped:
            dropped.append(so.step_id)
            ro.pooled.clear()
        return ro

    driver.runner.execute = drop_first_chunk
    driver.add(make_request("e", list(range(3, 23)), max_tokens=1, pooling="mean"))
    driver.run()
    assert driver.finish["e"] == "error" and driver.embeddings["e"] is None
    assert "pooled 12 of the prompt's 20 positions" in str(driver.errors["e"])
