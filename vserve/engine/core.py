"""The engine core: scheduler + executor, and the step functions every front end runs.

`step()` is the synchronous loop (one step in flight). `step_with_batch_queue()` keeps up to
`max_concurrent_batches` steps in flight: it schedules the next step from placeholders before
it waits for the oldest one, so the host never waits on the device to decide what runs next.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import time
import weakref
from collections import deque
from collections.abc import Callable

import msgspec

from vserve.config import EngineConfig
from vserve.core.kv_cache_manager import KVCacheManager
from vserve.core.request import Request, RequestStatus
from vserve.core.scheduler import Scheduler
from vserve.engine.grammars import constraint_digest, grammar_source
from vserve.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from vserve.engine.recorder import Coverage, StepRecorder
from vserve.engine.structured_output import StructuredOutputManager
from vserve.envs import read_env
from vserve.executor import make_executor
from vserve.executor.base import Executor
from vserve.sampling_params import StructuredOutputsParams
from vserve.startup import phase, resident_bytes

logger = logging.getLogger("vserve.engine")

GRAMMAR_WAIT = "structured output: sampling waits for older steps to advance the grammar"


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        with phase("workers started, model loaded", "engine_core"):
            self.executor = executor if executor is not None else make_executor(config)
        num_blocks = self.executor.num_kv_blocks()
        block_size = config.cache.block_size
        if num_blocks * block_size < config.model.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens, less than one "
                f"sequence of max_model_len={config.model.max_model_len}; lower max_model_len "
                "or give the cache more memory (kv_cache_memory_bytes, num_gpu_blocks_override)"
            )
        with phase("KV cache", "engine_core"):
            self.executor.init_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        self.num_local_kv_blocks = min(num_blocks, config.local_block_cap)
        kv = KVCacheManager(
            num_blocks,
            block_size,
            config.cache.enable_prefix_caching,
            config.cache.sliding_window,
            self.num_local_kv_blocks,
        )
        m = config.model
        self.structured = StructuredOutputManager(
            m.tokenizer, m.vocab_size, m.eos_token_ids, config.structured
        )
        # one copy of each constraint for every request that carries it (children of n > 1,
        # the prompts of one batch each arrive with their own decoded copy)
        self._constraints: weakref.WeakValueDictionary[
            tuple[str, str | None], StructuredOutputsParams
        ] = weakref.WeakValueDictionary()
        self._last_constraint: tuple[Callable[[], object], str] = (lambda: None, "")
        self.scheduler = Scheduler(config.scheduler, kv, config.speculative, self.structured)
        self.depth = config.max_concurrent_batches
        self.batch_queue: deque = deque()
        self.step_fn = self.step_with_batch_queue if self.depth > 1 else self.step
        self._aborts: queue.SimpleQueue[tuple[list[str], float]] = queue.SimpleQueue()
        self.recorder = StepRecorder()
        self.triton_compiles = 0  # the workers' Triton compiles while serving (cumulative)
        self._idle = True  # nothing ran since the engine last ran out of work
        self._draft_waits = 0  # the scheduler's count of requests held back for drafts ...
        self._held_for_drafts = False  # ... and whether the last schedule held one back
        self.debug_invariants = read_env().debug_invariants
        self._log_mode()

    def _log_mode(self) -> None:
        cfg = self.config
        if cfg.async_scheduling:
            logger.info("Asynchronous scheduling is enabled (batch queue depth %d).", self.depth)
        else:
            logger.info(
                "Asynchronous scheduling is off: %s (batch queue depth %d).",
                cfg.async_off_reason,
                self.depth,
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens).",
            self.num_kv_blocks,
            cfg.cache.block_size,
            self.num_kv_blocks * cfg.cache.block_size,
        )
        if cfg.cache.sliding_window is not None:
            logger.info(
                "KV cache of the sliding-window layers: %d blocks (window %d).",
                self.num_local_kv_blocks,
                cfg.cache.sliding_window,
            )

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest, seq: int = 0) -> None:
        """`seq`: the ADD's arrival number; an eager abort sent before it never applies."""
        request = Request(
            req.request_id,
            list(req.prompt_token_ids),
            req.sampling_params,
            eos_token_ids=tuple(req.eos_token_ids),
            sampling_seed=req.sampling_seed,
            cache_salt=req.cache_salt,
            arrival_time=req.arrival_time,
        )
        request.add_seq, request.incarnation = seq, req.incarnation
        constraint = req.sampling_params.structured_outputs  # request.use_grammar
        if constraint is not None:  # compiles off the busy loop; admitted once ready
            constraint, key = self._shared_constraint(constraint)
            request.sampling_params.structured_outputs = constraint
            request.grammar_future = self.structured.submit(constraint, key)
        self.scheduler.add_request(request)

    def _shared_constraint(
        self, constraint: StructuredOutputsParams
    ) -> tuple[StructuredOutputsParams, str]:
        """The one copy of this constraint, and its digest (hashed once for the children of
        a prompt, which arrive holding the same object). Copies that differ only in
        `starts_after` share the compiled grammar (the digest), not the copy."""
        last, key = self._last_constraint
        if last() is not constraint:
            key = constraint_digest(*grammar_source(constraint))
            self._last_constraint = (weakref.ref(constraint), key)
        return self._constraints.setdefault((key, constraint.starts_after), constraint), key

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is live (waiting or running)."""
        return request_id in self.scheduler.requests

    def abort_now(self, request_ids: list[str]) -> None:
        """Finish these requests as aborted at once (on the thread that runs the steps)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def abort_requests(self, request_ids: list[str], num_adds: float = math.inf) -> None:
        """Thread-safe: applied before the next commit (or at once by the busy loop), to the
        requests of those ids added by one of the first `num_adds` ADDs (not a new request
        that reuses an aborted id)."""
        self._aborts.put((list(request_ids), num_adds))

    def apply_aborts(self) -> None:
        """The queued aborts, now: between steps, on the thread that runs them."""
        while True:
            try:
                ids, num_adds = self._aborts.get_nowait()
            except queue.Empty:
                return
            requests = self.scheduler.requests
            ids = [i for i in ids if i in requests and requests[i].add_seq <= num_adds]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def waiting_for_grammars(self) -> bool:
        """True when the only work left is requests whose grammars still compile: a step
        now would be empty, so the loops wait for a compile instead (no busy spin)."""
        s = self.scheduler
        if (
            self.batch_queue
            or s.running
            or s.finished_req_ids
            or s.preempted_req_ids
            or s.has_error_outputs()
            or not s.waiting
        ):
            return False
        return all(
            r.grammar is None and r.grammar_future is not None and not r.grammar_future.done()
            for r in s.waiting
        )

    def has_work(self) -> bool:
        busy = self.scheduler.has_requests() or bool(self.batch_queue)
        if not busy:
            if self.debug_invariants and not self._idle:
                self.check_idle_invariants()
            self._idle = True
        return busy

    def check_idle_invariants(self) -> None:
        """With no request and no step in flight, every block is free (a leak otherwise):
        free + cached + in-use == total and in-use == 0. Debug mode runs it at each idle."""
        kv = self.scheduler.kv
        problem = next(filter(None, map(_pool_problem, kv.pools)), None)
        if problem is None and kv.req_blocks:
            problem = f"KV blocks held at idle for {sorted(kv.req_blocks)[:8]}"
        elif problem is not None:
            problem += f", held for {sorted(kv.req_blocks)[:8]}"
        if problem is None:
            try:
                self.scheduler.check_invariants()
            except AssertionError as e:
                problem = f"scheduler invariant broken: {e!r}"
        if problem is not None:
            logger.error("engine idle invariant violated: %s", problem)
            raise RuntimeError(f"engine idle invariant violated: {problem}")

    def process_memory(self) -> dict[str, int]:
        """Resident bytes of this process and of each worker process."""
        return {"engine_core": resident_bytes(), **self.executor.worker_memory()}

    # -- utilities: what a client may call by name; values are plain (msgpack) data ------------
    UTILITY_METHODS = frozenset(
        {
            "reset_prefix_cache",
            "take_step_records",
            "ping",
            "num_kv_blocks_info",
            "stats",
            "process_memory",
        }
    )

    def call_utility(self, method: str, *args):
        if method not in self.UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self, "_util_" + method)(*args)

    def _util_reset_prefix_cache(self) -> bool:
        return self.reset_prefix_cache()

    def _util_take_step_records(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.recorder.take()]

    def _util_ping(self) -> str:
        return "pong"

    def _util_num_kv_blocks_info(self) -> int:
        return self.num_kv_blocks

    def _util_process_memory(self) -> dict[str, int]:
        return self.process_memory()

    def _util_stats(self) -> dict:
        return msgspec.structs.asdict(self.make_stats())

    # -- the step loops ----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        self.apply_aborts()
        if not self.scheduler.has_requests():
            return []
        so = self._schedule()
        return self._commit(so, self._launch(so).result())  # nothing in flight before it

    def step_with_batch_queue(self) -> list[EngineCoreOutput] | None:
        """Fill the queue first; when full (or nothing more to schedule), commit the oldest.

        A step whose grammar requests still have tokens in flight is *deferred*: its forward
        is launched now, but its sampling (with the grammar bitmask) only after every older
        step that carries one of them has committed and advanced its grammar."""
        self.apply_aborts()
        deferred = None
        if self.scheduler.has_requests() and len(self.batch_queue) < self.depth:
            so = self._schedule()
            if so.pending_grammar and self.batch_queue:
                self.executor.execute_model(so, defer_sampling=True)
                deferred = so
            else:
                self.batch_queue.append((self._launch(so), so))
                if len(self.batch_queue) < self.depth and self.scheduler.has_requests():
                    return None
        if not self.batch_queue:
            return None
        outputs = self._commit_oldest()
        if deferred is not None:
            while self.scheduler.grammar_behind(deferred):  # at depth >= 3: in later ones too
                assert self.batch_queue, "a grammar request's older step is not in the queue"
                outputs += self._commit_oldest()
            self.scheduler.fill_grammar_bitmask(deferred)
            self.batch_queue.append((self.executor.sample_tokens(deferred), deferred))
        return outputs

    def _launch(self, so):
        """Launch a step whose grammars are current; their bitmask is filled while the
        forward runs (its sampling waits for it)."""
        if not so.grammar_req_ids:
            return self.executor.execute_model(so)
        self.executor.execute_model(so, defer_sampling=True)
        self.scheduler.fill_grammar_bitmask(so)
        return self.executor.sample_tokens(so)

    def _commit_oldest(self) -> list[EngineCoreOutput]:
        future, so = self.batch_queue.popleft()
        return self._commit(so, future.result())

    def _schedule(self):
        start = time.perf_counter()
        # nothing was running (an in-process client stops stepping once its requests finish,
        # leaving only an empty step in the queue): this step starts after idle
        self._idle |= not self.scheduler.running
        so = self.scheduler.schedule()
        self.recorder.scheduled(
            so,
            start,
            time.perf_counter(),
            len(self.batch_queue),
            self._no_overlap_reason(so),
            self._idle,
        )
        self._idle = False
        waits = self.scheduler.num_draft_waits
        self._held_for_drafts, self._draft_waits = waits != self._draft_waits, waits
        return so

    def _no_overlap_reason(self, so) -> str | None:
        """Why this step's device work waits for the host: no other step with tokens is in
        flight when it launches, or its sampling waits for older steps' tokens; None when
        it overlaps an earlier step."""
        if so.pending_grammar and self.batch_queue:
            return GRAMMAR_WAIT
        if any(queued.total_num_scheduled_tokens for _, queued in self.batch_queue):
            return None
        if self.depth == 1:
            return "async scheduling off: " + (self.config.async_off_reason or "depth 1")
        if self._idle:
            return "first step after idle"
        if self._held_for_drafts:
            return "speculative decoding: drafts need the previous step's tokens on the host"
        return "nothing could be scheduled ahead of the previous step"

    def _commit(self, so, runner_output) -> list[EngineCoreOutput]:
        self.apply_aborts()
        start = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, runner_output)
        self.recorder.committed(so, runner_output, start, time.perf_counter())
        timing = getattr(runner_output, "timing", None)
        if timing is not None:
            self.triton_compiles += timing.compiles
        return outputs

    # -- misc --------------------------------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.triton_compiles = self.triton_compiles
        recent = self.recorder.drain_recent()
        if recent:
            forwards = Coverage([(r.forward_start, r.forward_end) for r in recent if r.forward_end])
            stats.forward_times = [r.forward_end - r.forward_start for r in recent]
            stats.launch_intervals = [r.launch_interval for r in recent if r.launch_interval]
            stats.schedule_times = [r.schedule_end - r.schedule_start for r in recent]
            stats.schedule_exposed = [
                forwards.exposed(r.schedule_start, r.schedule_end) for r in recent
            ]
            for r in recent:
                if r.no_overlap and r.num_tokens:
                    stats.no_overlap_steps[r.no_overlap] = (
                        stats.no_overlap_steps.get(r.no_overlap, 0) + 1
                    )
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()


def _pool_problem(pool) -> str | None:
    """What is wrong with a block pool at idle: free + cached + in use != total, or in use."""
    in_use = pool.num_used_blocks
    cached = sum(b.block_hash is not None for b in pool.blocks if b.ref_cnt == 0)
    uncached_free = pool.num_free_blocks - cached
    if uncached_free + cached + in_use != pool.num_blocks:
        return (
            f"free {uncached_free} + cached {cached} + in use {in_use} != total {pool.num_blocks}"
        )
    return f"{in_use} KV blocks in use at idle" if in_use else None
