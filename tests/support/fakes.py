"""A fake worker and a driver for scheduler tests without torch.

`FakeRunner` behaves like a real worker: it keeps its own copy of every request's tokens,
receives only deltas after a request's first step, appends the tokens it samples itself
(so it can run ahead of the scheduler, as the real worker does with its on-device ids), and
derives each token from the sequence so far -- so a recomputed position gets the same token,
as with a real greedy model.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from vserve.core.kv_cache_manager import KVCacheManager
from vserve.core.request import Request
from vserve.core.sched_output import RunnerOutput, SchedulerOutput
from vserve.core.scheduler import Scheduler, SchedulerConfig
from vserve.executor.base import Executor
from vserve.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


def fake_hidden(tokens: list[int], position: int) -> list[float]:
    """The fake model's hidden state at a position: its token, the position, a constant."""
    return [float(tokens[position]), float(position), 1.0]


def fake_token(
    tokens: list[int], eos_after: int | None = None, prompt_len: int = 0, period: int | None = None
) -> int:
    """Deterministic next token for a sequence; EOS once `eos_after` outputs exist. With a
    `period`, the model mostly repeats what it saw `period` tokens ago (repetitive text, on
    which n-gram drafts get accepted) and now and then departs from it."""
    if eos_after is not None and len(tokens) - prompt_len >= eos_after:
        return EOS
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=4).digest()
    value = int.from_bytes(digest, "little")
    if period is not None and len(tokens) >= period and value % 7:
        return tokens[-period]
    return value % (VOCAB - 1)


@dataclass
class _FakeReq:
    epoch: int
    tokens: list[int]
    num_prompt: int
    eos_after: int | None
    period: int | None = None
    pooling: str | None = None
    computed: int = 0  # positions computed before the step being run


class FakeRunner:
    """`periods` gives some requests their own period (others use `period`). With
    `check_grammar`, a step's grammar bitmask (from `FakeStructured`) must have been filled
    after the grammar accepted every earlier output of its request, else `execute` raises."""

    def __init__(
        self,
        eos_after: dict[str, int] | None = None,
        period: int | None = None,
        periods: dict[str, int] | None = None,
        check_grammar: bool = False,
    ) -> None:
        self.check_grammar = check_grammar
        self.num_grammar_rows = 0
        self.reqs: dict[str, _FakeReq] = {}
        self.eos_after = eos_after or {}
        self.period = period
        self.periods = periods or {}
        self.steps: list[SchedulerOutput] = []

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.steps.append(so)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = _FakeReq(
                new.epoch,
                list(new.token_ids),
                new.num_prompt_tokens,
                self.eos_after.get(new.req_id),
                self.periods.get(new.req_id, self.period),
                new.sampling_params.pooling,
                new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.reqs[req_id].computed = num_computed
        ro = RunnerOutput(so.step_id)
        for req_id, num in so.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            assert req.epoch == so.req_epochs[req_id], "worker and scheduler disagree on epoch"
            if req.pooling is not None:
                self._pool(ro, req_id, req, req.computed, req.computed + num)
            req.computed += num
            if self.check_grammar and req_id in so.grammar_req_ids:
                self._check_mask(so, req_id, len(req.tokens) - req.num_prompt)
            if req_id in so.sampling_req_ids:
                out = self._verify(req, so.spec_token_ids.get(req_id, []))
                req.tokens.extend(out)
                ro.req_ids.append(req_id)
                ro.sampled_token_ids.append(out)
        return ro

    @staticmethod
    def _pool(ro: RunnerOutput, req_id: str, req: _FakeReq, start: int, end: int) -> None:
        """As workers/pooling.py does, with `fake_hidden` for the hidden states."""
        end = min(end, req.num_prompt)
        if req.pooling == "last":
            start = max(start, req.num_prompt - 1)
        if end > start:
            rows = [fake_hidden(req.tokens, p) for p in range(start, end)]
            total = np.sum(rows, axis=0, dtype=np.float32)
            ro.pooled[req_id] = (end - start, total.astype("<f4").tobytes())

    def _check_mask(self, so: SchedulerOutput, req_id: str, num_outputs: int) -> None:
        marks = so.grammar_bitmask
        masked_at = marks[so.grammar_req_ids.index(req_id)] if marks is not None else None
        assert masked_at == num_outputs, (
            f"step {so.step_id}: {req_id}'s bitmask was filled after its grammar accepted "
            f"{masked_at} outputs, but it samples output #{num_outputs}"
        )
        self.num_grammar_rows += 1

    def _verify(self, req: _FakeReq, drafts: list[int]) -> list[int]:
        """Greedy verification: accept drafts while they equal the model's own pick, then
        add the model's pick at the first mismatch (or after the last draft)."""
        seq, out = list(req.tokens), []
        for draft in drafts + [None]:
            token = fake_token(seq, req.eos_after, req.num_prompt, req.period)
            out.append(token)
            seq.append(token)
            if token != draft:
                break
        return out


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    async_scheduling=True,
    prefix_caching=True,
    spec=None,
    pp: int = 1,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=pp,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching), spec)


def make_request(
    req_id: str, prompt: list[int], max_tokens: int = 8, eos=(EOS,), **sampling
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return Request(req_id, list(prompt), sp, eos_token_ids=tuple(eos))


class Driver:
    """Runs scheduler + fake runner with up to `depth` steps in flight, checking invariants
    after every schedule and every commit."""

    def __init__(
        self, scheduler: Scheduler, runner: FakeRunner | None = None, depth: int = 2
    ) -> None:
        self.sched = scheduler
        self.runner = runner or FakeRunner()
        self.depth = depth
        self.queue: deque[tuple[SchedulerOutput, RunnerOutput]] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.stop_reasons: dict[str, object] = {}
        self.embeddings: dict[str, bytes | None] = {}
        self.errors: dict[str, str | None] = {}
        self.emitted_after_finish: list[str] = []
        self.num_steps = 0
        self._settled: dict[str, tuple[int, int]] = {}

    def add(self, req: Request) -> None:
        self.sched.add_request(req)
        self.outputs.setdefault(req.request_id, [])

    def step(self) -> list:
        """One call of the engine's step_with_batch_queue."""
        if self.sched.has_requests() and len(self.queue) < self.depth:
            so = self.sched.schedule()
            self._check(so)
            self.queue.append((so, self.runner.execute(so)))
            if len(self.queue) < self.depth and self.sched.has_requests():
                return []
        if not self.queue:
            return []
        so, ro = self.queue.popleft()
        outs = self.sched.update_from_output(so, ro)
        self.num_steps += 1
        for out in outs:
            if out.request_id in self.finish:
                self.emitted_after_finish.append(out.request_id)
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                self.embeddings[out.request_id] = out.embedding
                self.errors[out.request_id] = out.error
                self.finish[out.request_id] = out.finish_reason
                self.stop_reasons[out.request_id] = out.stop_reason
        self._check(None)
        return outs

    def run(self, max_steps: int = 10_000, on_step=None) -> None:
        for i in range(max_steps):
            if not (self.sched.has_requests() or self.queue):
                return
            self.step()
            if on_step:
                on_step(i, self)
        raise AssertionError("requests did not finish")

    def _check(self, so: SchedulerOutput | None) -> None:
        sched = self.sched
        sched.check_invariants()
        if so is not None:
            cfg = sched.config
            assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
            assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
            assert all(n > 0 for n in so.num_scheduled_tokens.values())
        for req in sched.running:
            # C - PH never decreases while a request keeps running in one epoch
            key = (req.epoch, req.num_computed_tokens - req.num_output_placeholders)
            prev = self._settled.get(req.request_id)
            if prev is not None and prev[0] == req.epoch:
                assert key[1] >= prev[1], (req, prev)
            self._settled[req.request_id] = key


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB - 1) for _ in range(length)]


def expected_tokens(
    prompt: list[int],
    max_tokens: int,
    eos_after: int | None = None,
    max_model_len: int = 10**9,
    period: int | None = None,
) -> list[int]:
    tokens = list(prompt)
    out = []
    while len(out) < max_tokens and len(tokens) < max_model_len:
        t = fake_token(tokens, eos_after, len(prompt), period)
        tokens.append(t)
        out.append(t)
        if t == EOS:
            break
    return out


# -- engine-loop fakes -------------------------------------------------------------------------
class ControlledFuture:
    """A step future whose resolution the test observes (and can make fail)."""

    def __init__(self, executor, so, output, error=None) -> None:
        self.executor, self.so, self.output, self.error = executor, so, output, error
        self.resolved = False

    def result(self, timeout=None):
        self.executor.resolve_order.append(self.so.step_id)
        for hook in self.executor.on_resolve:
            hook(self)
        self.resolved = True
        if self.error is not None:
            raise self.error
        return self.output


class FakeExecutor(Executor):
    """Executor whose model is FakeRunner; records launches and resolutions. A step launched
    with `defer_sampling` runs (and samples) only at `sample_tokens`, which must follow
    before any other launch, as the real worker's single deferred slot requires."""

    def __init__(
        self,
        num_blocks: int = 64,
        runner: FakeRunner | None = None,
        fail_at_step: int | None = None,
    ) -> None:
        self.runner = runner or FakeRunner()
        self.blocks = num_blocks
        self.launched: list[int] = []
        self.deferred_ids: list[int] = []
        self.masked_at_launch: list[int] = []  # bitmask filled before the forward launched
        self.resolve_order: list[int] = []
        self.on_resolve: list = []
        self.fail_at_step = fail_at_step
        self.max_in_flight = 0
        self._deferred = None

    def num_kv_blocks(self) -> int:
        return self.blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, so, defer_sampling: bool = False):
        assert self._deferred is None, "a step launched before the deferred one sampled"
        self.launched.append(so.step_id)
        if so.grammar_bitmask is not None:
            self.masked_at_launch.append(so.step_id)
        if defer_sampling:
            self._deferred = so
            self.deferred_ids.append(so.step_id)
            return None
        return self._run(so)

    def sample_tokens(self, so):
        assert self._deferred is so, "sample_tokens for a step that was not deferred"
        self._deferred = None
        return self._run(so)

    def _run(self, so):
        error = None
        if self.fail_at_step == len(self.launched):
            error = RuntimeError(f"forward failed at step {so.step_id}")
            output = None
        else:
            output = self.runner.execute(so)
        future = ControlledFuture(self, so, output, error)
        in_flight = len(self.launched) - len(self.resolve_order)
        self.max_in_flight = max(self.max_in_flight, in_flight)
        return future


class FakeGrammar:
    """Accepts every token and counts them."""

    def __init__(self) -> None:
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return False


class FakeStructured:
    """Stands in for StructuredOutputManager: a bitmask row records how many tokens its
    request's grammar had accepted when the row was filled (FakeRunner checks it)."""

    def submit(self, params, key=None):
        from concurrent.futures import Future

        future = Future()
        future.set_result(None)
        return future

    def new_state(self, compiled, starts_after=None) -> FakeGrammar:
        return FakeGrammar()

    def allocate_bitmask(self, num_rows: int) -> list:
        return [None] * num_rows

    def fill(self, state: FakeGrammar, bitmask: list, row: int) -> None:
        bitmask[row] = state.num_accepted

    def release(self, compiling) -> None:
        pass

    def shutdown(self) -> None:
        pass


def fake_engine_config(
    async_scheduling: bool = True,
    pp: int = 1,
    block_size: int = 4,
    max_model_len: int = 128,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    speculative=None,
):
    from vserve.config import (
        CacheConfig,
        DeviceConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
    )

    model = ModelConfig(
        model="fake",
        tokenizer="fake",
        architecture="Fake",
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        eos_token_ids=(EOS,),
        served_model_name="fake",
    )
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=pp,
    )
    return EngineConfig(
        model,
        CacheConfig(block_size=block_size),
        sched,
        ParallelConfig(
            pipeline_parallel_size=pp, distributed_executor_backend="mp" if pp > 1 else "uni"
        ),
        DeviceConfig(),
        async_scheduling,
        None if async_scheduling else "off in this test",
        speculative,
    )


def core_request(req_id: str, prompt: list[int], max_tokens: int = 8, **sampling):
    from vserve.engine.messages import EngineCoreRequest

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return EngineCoreRequest(req_id, list(prompt), sp, [EOS], 0)
