"""The feedback queue's numpy fast path (rows unchanged since the push) plans and writes back
exactly what the request-by-request path does, on random batches."""

import random

import numpy as np
import pytest
import torch

from vserve.core.sched_output import NewRequestData
from vserve.sampling_params import SamplingParams
from vserve.workers.feedback import FeedbackQueue
from vserve.workers.input_batch import InputBatch
from vserve.workers.input_prep import HostInputs


def _batch(rng: random.Random, num_reqs: int) -> InputBatch:
    batch = InputBatch(32, 64, 8)
    for k in range(num_reqs):
        n = rng.randrange(2, 20)
        batch.add(
            NewRequestData(
                f"r{k}",
                rng.randrange(1, 4),
                list(range(1, n + 1)),
                n,
                SamplingParams(),
                0,
                [],
                ([],),
                n - 1,
            )
        )
    for k in rng.sample(range(num_reqs), num_reqs // 4):  # holes, then rows move down
        batch.remove(f"r{k}")
    batch.condense()
    return batch


def _step(rng: random.Random, batch: InputBatch):
    """A step over a random subset of rows; each computes 1-3 tokens from a position at or
    before its newest placeholder."""
    rows = np.array(
        sorted(rng.sample(sorted(batch.row_of.values()), len(batch.row_of) // 2 + 1)),
        dtype=np.int64,
    )
    computed = np.array([batch.num_tokens[r] - rng.randrange(1, 3) for r in rows], np.int64)
    num_sched = np.array([rng.randrange(1, 4) for _ in rows], np.int64)
    qsl = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(num_sched, out=qsl[1:])
    positions = np.repeat(computed, num_sched) + (
        np.arange(qsl[-1]) - np.repeat(qsl[:-1], num_sched)
    )
    tokens = batch.token_ids[np.repeat(rows, num_sched), positions].copy()
    host = HostInputs(
        qsl,
        computed,
        positions,
        computed + num_sched,
        np.zeros((len(rows), 1), np.int32),
        tokens,
        16,
    )
    return rows, host


@pytest.mark.parametrize("seed", range(20))
def test_fast_plan_and_write_back_match_the_slow_path(seed):
    rng = random.Random(seed)
    batch = _batch(rng, 24)
    sampled = sorted(rng.sample(sorted(batch.row_of.values()), len(batch.row_of) // 2))
    req_ids = [batch.rows[r].req_id for r in sampled]
    batch.append_placeholders(np.array(sampled, np.int64))
    ids = torch.arange(100, 100 + len(sampled))
    queue = FeedbackQueue()
    fb = queue.push(1, batch, sampled, req_ids, ids)
    rows, host = _step(rng, batch)
    step_req_ids = [batch.rows[r].req_id for r in rows.tolist()]
    host.host_tokens[host.host_tokens < 0] = 0  # the plan's check is not under test here
    fast = queue.plan(batch, host, step_req_ids, rows)
    fb.layout_version = -1  # as if rows had moved: request by request
    slow = queue.plan(batch, host, step_req_ids, rows)
    assert vars(fast) == vars(slow)
    assert fast.rows  # the case is not vacuous
    expect = batch.token_ids.copy()
    for (req_id, epoch, pos), token in zip(fb.entries, ids.tolist()):
        expect[batch.row_of[req_id], pos] = token
    fb.layout_version = batch.layout_version
    queue.flush(batch, keep_latest=False)
    assert np.array_equal(batch.token_ids, expect)


def test_a_moved_row_is_not_planned_from_its_old_place():
    rng = random.Random(0)
    batch = _batch(rng, 8)
    rows = sorted(batch.row_of.values())
    req_ids = [batch.rows[r].req_id for r in rows]
    batch.append_placeholders(np.array(rows, np.int64))
    queue = FeedbackQueue()
    fb = queue.push(1, batch, rows, req_ids, torch.arange(len(rows)))
    batch.remove(req_ids[0])
    batch.condense()  # the last row moves into row 0
    assert not fb.rows_valid(batch)
    queue.flush(batch, keep_latest=False)
    moved = batch.row_of[req_ids[-1]]
    assert batch.token_ids[moved, batch.num_tokens[moved] - 1] == len(rows) - 1
