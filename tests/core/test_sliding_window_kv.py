"""Sliding-window layers keep only their window's KV blocks: the scheduler returns blocks that
left every future query's window, with steps in flight (async, PP), prefix hits and preemption,
and outputs stay token-identical.

The scheduler tests run a fake worker that keeps a paged KV store per group: each step writes
every scheduled position's content (the token prefix it encodes) through the block tables the
scheduler sent, and every query reads its visible keys back through them; a block handed to
another request too early, or a wrong prefix hit, reads the wrong content."""

from __future__ import annotations

import random

import pytest

from tests.support.fakes import Driver, FakeRunner, make_request, random_prompt
from vserve.core.kv_cache_manager import KVCacheManager
from vserve.core.scheduler import Scheduler, SchedulerConfig
from vserve.core.sliding_window import NO_BLOCK, local_block_cap, out_of_window


class PagedKVRunner(FakeRunner):
    """A FakeRunner that also plays the paged KV cache of a full and a sliding-window group."""

    def __init__(self, window: int, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.window, self.block_size = window, block_size
        self.tables: dict[str, tuple[list[int], list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.store: dict[tuple[int, int, int], tuple] = {}  # (group, block, offset) -> content
        self.num_reads = 0

    def execute(self, so):
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.tables.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = tuple(list(ids) for ids in new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            for table, new_ids in zip(self.tables[req_id], ids, strict=True):
                table.extend(new_ids)
            self.computed[req_id] = num_computed
        tokens_before = {
            r: list(self.reqs[r].tokens) for r in so.num_scheduled_tokens if r in self.reqs
        }
        for new in so.scheduled_new_reqs:
            tokens_before[new.req_id] = list(new.token_ids)
        for req_id, n in so.num_scheduled_tokens.items():
            self._forward(req_id, tokens_before[req_id], self.computed[req_id], n)
            self.computed[req_id] += n
        return super().execute(so)

    def _slot(self, req_id: str, group: int, pos: int) -> tuple[int, int, int]:
        block = self.tables[req_id][group][pos // self.block_size]
        assert block != NO_BLOCK, f"{req_id} reads or writes position {pos} in a dead block"
        return group, block, pos % self.block_size

    def _forward(self, req_id: str, tokens: list[int], first: int, n: int) -> None:
        for pos in range(first, first + n):
            content = tuple(tokens[: pos + 1])
            for group in (0, 1):
                self.store[self._slot(req_id, group, pos)] = content
        for pos in range(first, first + n):
            for key in range(pos + 1):  # full attention: every key; local: the window
                groups = (0, 1) if key > pos - self.window else (0,)
                for group in groups:
                    got = self.store.get(self._slot(req_id, group, key))
                    assert got == tuple(tokens[: key + 1]), (req_id, group, pos, key)
                    self.num_reads += 1


def _scheduler(
    window,
    num_blocks,
    num_local,
    block_size=4,
    max_num_seqs=6,
    batched=24,
    async_on=True,
    pp=1,
    prefix=True,
):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        max_model_len=160,
        async_scheduling=async_on,
        pipeline_parallel_size=pp,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix, window, num_local))


MODES = {
    "sync": (False, 1, 1),
    "async": (True, 1, 2),
    "pp2-sync": (False, 2, 2),
    "pp2-async": (True, 2, 3),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_blocks", [400, 70])  # 70: preemption
def test_window_blocks_are_returned_with_steps_in_flight(mode, num_blocks):
    async_on, pp, depth = MODES[mode]
    window, bs = 8, 4
    rng = random.Random(7)
    num_local = local_block_cap(window, bs, 6, 24, depth)
    sched = _scheduler(window, num_blocks, num_local, async_on=async_on, pp=pp)
    runner = PagedKVRunner(window, bs)
    driver = Driver(sched, runner, depth=depth)
    shared = random_prompt(rng, 30)
    for i in range(14):
        prompt = (
            shared + random_prompt(rng, rng.randrange(1, 30))
            if i % 2
            else random_prompt(rng, rng.randrange(5, 60))
        )
        driver.add(make_request(f"r{i}", prompt, max_tokens=rng.randrange(10, 60)))
    local = sched.kv.local
    allocated = [0]
    get_new_blocks = local.pool.get_new_blocks

    def counting(n):
        allocated[0] += n
        return get_new_blocks(n)

    local.pool.get_new_blocks = counting
    peak = [0, 0]

    def on_step(i, drv):
        peak[0] = max(peak[0], sched.kv.pool.num_used_blocks)
        peak[1] = max(peak[1], local.pool.num_used_blocks)
        for req in sched.running:  # live window blocks: the window and this step's tokens
            entries = local.req_blocks[req.request_id]
            first = out_of_window(req.num_computed_tokens - 24, window, bs)
            assert all(b is None for b in entries[:first]), req.request_id

    driver.run(on_step=on_step)
    assert len(driver.finish) == 14 and runner.num_reads > 0
    assert sched.kv.pool.num_used_blocks == 0 and local.pool.num_used_blocks == 0
    assert allocated[0] > num_local  # blocks were recycled while requests ran
    assert peak[1] < peak[0] / 2  # the window group holds a fraction of the full one
    if num_blocks == 70:
        assert sched.num_preemptions > 0
    else:
        assert sched.kv.num_hit_tokens > 0


def test_prefix_hit_needs_the_window_before_it_cached():
    window, bs = 8, 4
    sched = _scheduler(window, 200, 40, async_on=False)
    runner = PagedKVRunner(window, bs)
    driver = Driver(sched, runner, depth=1)
    prompt = list(range(100, 140))
    driver.add(make_request("a", prompt, max_tokens=4))
    driver.run()
    kv = sched.kv
    b = make_request("b", prompt + [7, 8, 9], max_tokens=1)
    hit, num_hit = kv.get_computed_blocks(b)
    # a's early window blocks went back to the pool uncached-or-cached; the hit needs only
    # the two blocks before position num_hit in the window group
    assert num_hit == 40 and len(hit.full) == 10
    assert hit.local[:8] == [None] * 8 and all(x is not None for x in hit.local[8:])
    for block in hit.local[8:]:  # evict the window before the hit: a shorter hit, or none
        kv.local.pool._evict(block)
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit < 40
    driver.add(b)
    driver.run()  # the fake worker checks every key b reads
    assert driver.finish["b"] == "length"


# -- the real engine: tiny Gemma 3 (5 sliding-window layers, window 8, for 1 global) ----------
ENGINE = dict(
    dtype="float32", max_model_len=160, block_size=4, max_num_batched_tokens=32, max_num_seqs=4
)
ENGINE_MODES = {  # (PP=2 sync's cadence is covered by the fake-worker test above)
    "sync": dict(async_scheduling=False, distributed_executor_backend="uni"),
    "async": dict(async_scheduling=True, distributed_executor_backend="mp"),
    "pp2-async": dict(async_scheduling=True, pipeline_parallel_size=2),
}


def _gemma_run(model_dir, prompts, max_tokens, **mode):
    from vserve import SamplingParams
    from vserve.engine.arg_utils import EngineArgs
    from vserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model_dir, **ENGINE, **mode), multiprocess=False
    )
    core = engine.client.core
    kv = core.scheduler.kv
    peak = [0, 0]
    schedule = core.scheduler.schedule

    def schedule_and_measure():
        so = schedule()
        peak[0] = max(peak[0], kv.pool.num_used_blocks)
        peak[1] = max(peak[1], kv.local.pool.num_used_blocks)
        return so

    core.scheduler.schedule = schedule_and_measure
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, sp)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert kv.pool.num_used_blocks == 0 and kv.local.pool.num_used_blocks == 0
        core.check_idle_invariants()
        return [done[f"r{i}"] for i in range(len(prompts))], peak, kv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def gemma_reference(tiny_model_dir):
    from tests.support.hf_reference import PREFIX_PROMPTS, PROMPTS, hf_greedy

    model_dir = tiny_model_dir("gemma3", sliding_window=8)
    prompts = PREFIX_PROMPTS[:2] + PROMPTS[:3]  # the second hits the first's blocks
    return model_dir, prompts, hf_greedy(model_dir, tuple(prompts), 40)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("sync", marks=pytest.mark.slow),
        "async",  # the default: the fast tier's case
        pytest.param("pp2-async", marks=pytest.mark.slow),
    ],
)
def test_gemma3_window_freeing_is_token_identical(gemma_reference, mode):
    model_dir, prompts, expected = gemma_reference
    got, peak, kv = _gemma_run(model_dir, prompts, 40, **ENGINE_MODES[mode])
    assert got == expected  # transformers' greedy tokens (so also sync PP=1's)
    assert kv.local.window == 8
    assert peak[1] <= peak[0] // 2  # the window group holds a fraction of the full one
    assert kv.num_hit_tokens > 0  # the shared-prefix prompts hit the cache
