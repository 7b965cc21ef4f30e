"""Structured output with xgrammar: compile grammars off the busy loop, within a budget, once
per distinct constraint; keep one matcher per request, and fill token bitmasks for the rows
that sample.

Grammars compile off the busy loop (`StructuredOutputManager`); a request waits in the queue
until its grammar is ready, so the busy loop never compiles. A matcher advances only
on confirmed tokens (the scheduler's commit), never on in-flight ones: a preempted request's
matcher is therefore already where its recomputation starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from vserve.config import StructuredOutputConfig
from vserve.core.outputs import ERROR_BUSY, ERROR_INVALID, RequestError
from vserve.core.structured import GrammarMatcher
from vserve.engine import grammar_worker
from vserve.engine.grammar_worker import CompileWorker, Job
from vserve.engine.grammars import BytesLRU, compile_source, constraint_digest, grammar_source
from vserve.engine.text_gate import TextGate
from vserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # imported when first used
    import xgrammar as xgr

logger = logging.getLogger("vserve.engine")


class GrammarState:
    """One request's matcher, behind a gate while the output has not reached the text the
    constraint starts after (`text_gate.py`): meanwhile every token is allowed."""

    def __init__(self, matcher, gate: TextGate | None = None) -> None:
        self.matcher = matcher
        self.gate = gate

    def accept(self, token_id: int) -> bool:
        if self.gate is not None:
            if self.gate.feed(token_id):
                self.gate = None  # the constraint starts with the next token
            return True
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.gate is None and self.matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        if self.gate is None:  # else the row stays as allocated: every token allowed
            self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles each distinct constraint once, for every request that waits for it.

    `submit` gives a request a future of its compiled grammar: at once from the cache of
    compiled grammars (bounded in bytes), or shared with a compile already under way, or a new
    job. A job is tried first in the compile worker (`grammar_worker.py`: a deadline and a
    memory limit, past which it fails with `RequestError` for its requests only), then
    compiled here at the cost it showed there. `release` is called when a request ends: a job
    that no request waits for any more leaves the queue, or its trial is killed.

    | bound                              | where                                   |
    |------------------------------------|-----------------------------------------|
    | one constraint's source            | `max_constraint_chars` (front end)      |
    | a compile's time and memory        | `compile_timeout`, `compile_memory_mb`  |
    | distinct compiles waiting          | `MAX_PENDING_COMPILES` (more: busy)     |
    | compiled grammars kept             | `CACHE_BYTES` of xgrammar's own count   |
    | compiled grammars requests hold    | `LIVE_FACTOR` x `compile_memory_mb`     |
    |                                    | (a new one past it: busy)               |
    """

    MAX_PENDING_COMPILES = 64
    CACHE_BYTES = 256 << 20

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        config: StructuredOutputConfig | None = None,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.config = config or StructuredOutputConfig()
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: Any = None  # xgrammar's TokenizerInfo, made with the compiler
        self._vocab: list[bytes] | None = None  # its decoded vocabulary (gates read it)
        self._worker: CompileWorker | None = None
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # digest -> the job of every request waiting for it
        self._of_future: dict[Future, _Job] = {}
        self._queue: deque[_Job] = deque()
        self._wake = threading.Condition(self._lock)
        self._cache = BytesLRU(self.CACHE_BYTES)
        self._live = _LiveGrammars()  # the grammars requests hold, and their bytes
        self._live_limit = LIVE_FACTOR * (self.config.compile_memory_mb << 20)
        self._local = ThreadPoolExecutor(1, thread_name_prefix="vserve-grammar")
        self._thread: threading.Thread | None = None
        self._closed = False
        self._compiled = threading.Event()  # a compile finished since the last wait
        self.on_compiled: Callable[[], None] | None = None  # the engine core's wake-up
        self._compile_delay = _injected_delay()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, params: StructuredOutputsParams, key: str | None = None) -> Future:
        """The future of `params`' compiled grammar, for one request (`key`: its digest,
        when the caller has it)."""
        kind, source = grammar_source(params)
        key = key or constraint_digest(kind, source)
        with self._lock:
            future = self._future_for(key, kind, source)
            self._live.hold(future, key)
        future.add_done_callback(self._done)
        return future

    def _future_for(self, key: str, kind: str, source: str) -> Future:
        """(Under the lock.) A running job's future, a cached grammar's, or a new job's."""
        job = self._jobs.get(key)
        if job is not None:
            job.holders += 1
            return job.future
        future: Future = Future()
        compiled = self._cache.get(key)
        if compiled is not None:
            self._live.sized(key, self._cache.size(key))
            future.set_result(compiled)
        elif len(self._jobs) >= self.MAX_PENDING_COMPILES:
            message = f"{self.MAX_PENDING_COMPILES} grammars are compiling; retry later"
            future.set_exception(RequestError(f"structured outputs: {message}", ERROR_BUSY))
        else:
            job = _Job(key, kind, source, future)
            self._jobs[key] = self._of_future[future] = job
            self._queue.append(job)
            self._start()
            self._wake.notify()
        return future

    def release(self, compiling: Future) -> None:
        with self._lock:
            self._live.drop(compiling)
            job = self._of_future.get(compiling)
            if job is None:
                return
            job.holders -= 1
            if job.holders > 0:
                return
            self._forget(job)  # a request of the same constraint from now on starts afresh
            if job.state == _QUEUED:
                self._queue.remove(job)
                job.future.cancel()
            elif job.state == _TRIAL and self._worker is not None:
                job.state = _ABANDONED
                self._worker.kill()  # under the lock: the next job cannot have started

    def _done(self, _: Future) -> None:
        self._compiled.set()
        if self.on_compiled is not None:
            self.on_compiled()

    def wait_compiled(self, timeout: float) -> None:
        """Block until a compile finishes (or `timeout`): while only compiling requests
        wait, a step would be empty, so the loop sleeps here instead of spinning."""
        self._compiled.wait(timeout)
        self._compiled.clear()

    # -- grammars for the scheduler ------------------------------------------------------------
    def new_state(self, compiled, starts_after: str | None = None) -> GrammarState:
        import xgrammar as xgr

        gate = None if starts_after is None else TextGate(starts_after, self._vocab_bytes())
        return GrammarState(xgr.GrammarMatcher(compiled), gate)

    def _vocab_bytes(self) -> list[bytes]:
        """Each token's bytes (xgrammar's decoded vocabulary), read once: a compiled grammar
        exists, so the compiler and its tokenizer info do too."""
        if self._vocab is None:
            self._get_compiler()
            self._vocab = list(self._info.decoded_vocab)
        return self._vocab

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.vocab_size).numpy()

    def fill(self, state: GrammarMatcher, bitmask: np.ndarray, row: int) -> None:
        import torch

        cast(GrammarState, state).fill(torch.from_numpy(bitmask), row)  # made by new_state

    # -- the jobs --------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, daemon=True, name="vserve-grammar-jobs"
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.state = _TRIAL
            try:
                self._trial(job)
            except Exception as e:  # noqa: BLE001 -- fails its requests, not the engine
                logger.exception("structured outputs: a grammar job failed")
                self._finish(job, error=e)

    def _trial(self, job: _Job) -> None:
        if self._compile_delay:
            time.sleep(self._compile_delay)
        worker = self._get_worker()
        verdict = worker.check(Job(job.kind, job.source), self.config.compile_timeout)
        with self._lock:
            if job.state == _ABANDONED or job.holders == 0:
                job.future.cancel()
                return
            job.state = _LOCAL
            over = self._live.num_bytes + verdict.memory_bytes > self._live_limit
        if verdict.ok and over:
            message = (
                f"structured outputs: the grammars of running requests hold "
                f"{self._live.num_bytes >> 20} MiB; retry later"
            )
            self._finish(job, error=RequestError(message, ERROR_BUSY))
            return
        if not verdict.ok:
            flag = (
                "--grammar-compile-timeout"
                if "within" in (verdict.error or "")
                else "--grammar-compile-memory-mb"
                if "MiB" in (verdict.error or "")
                else None
            )
            message = f"structured outputs: {verdict.error}" + (f" ({flag})" if flag else "")
            self._finish(job, error=RequestError(message, ERROR_INVALID))
            return
        with self._lock:
            if self._closed:
                return
            self._local.submit(self._compile_here, job, verdict.memory_bytes)

    def _compile_here(self, job: _Job, size: int) -> None:
        try:
            compiled = compile_source(self._get_compiler(), job.kind, job.source)
        except Exception as e:  # noqa: BLE001 -- fails its requests, not the engine
            logger.exception("structured outputs: a grammar that passed its trial failed")
            self._finish(job, error=e)
            return
        size = compiled.memory_size_bytes or size
        self._cache.put(job.key, compiled, size)
        with self._lock:
            self._live.sized(job.key, size)
        self._finish(job, result=compiled)

    def _finish(self, job: _Job, result=None, error: BaseException | None = None) -> None:
        with self._lock:
            self._forget(job)
        if not job.future.done():
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def _forget(self, job: _Job) -> None:
        """(Under the lock.) The job is no longer shared with new requests."""
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        self._of_future.pop(job.future, None)

    # -- xgrammar --------------------------------------------------------------------------------
    def _tokenizer_info(self):
        import xgrammar as xgr

        from vserve.tokenizer import load_tokenizer

        return xgr.TokenizerInfo.from_huggingface(
            load_tokenizer(self.tokenizer_path),
            vocab_size=self.vocab_size,
            stop_token_ids=self.eos_token_ids,
        )

    def _get_compiler(self):
        """Made by the job thread, before any job reaches the local compile thread."""
        if self._compiler is None:
            import xgrammar as xgr

            self._info = self._tokenizer_info()
            self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
        return self._compiler

    def _get_worker(self) -> CompileWorker:
        if self._worker is None:
            started = grammar_worker.spawn()  # its imports run beside this process's own
            try:
                self._get_compiler()
                info = self._info.serialize_json()
            except BaseException:
                started.kill()
                started.wait()
                raise
            self._worker = CompileWorker(info, self.config.compile_memory_mb, started)
        return self._worker

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
        self._local.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()


_QUEUED, _TRIAL, _ABANDONED, _LOCAL = "queued", "trial", "abandoned", "local"
LIVE_FACTOR = 2  # compiled grammars held by requests: at most this many compile budgets


class _LiveGrammars:
    """(Under the manager's lock.) Per constraint, the requests that hold its grammar (or
    wait for it) and its size once known; the total of those sizes."""

    def __init__(self) -> None:
        self.num_bytes = 0
        self._holders: dict[str, list[int]] = {}  # digest -> [requests, bytes]
        self._uses: dict[Future, list] = {}  # future -> [digest, requests using it]

    def hold(self, future: Future, key: str) -> None:
        self._holders.setdefault(key, [0, 0])[0] += 1
        self._uses.setdefault(future, [key, 0])[1] += 1

    def sized(self, key: str, size: int) -> None:
        entry = self._holders.get(key)
        if entry is not None and entry[1] == 0:
            entry[1] = size
            self.num_bytes += size

    def drop(self, future: Future) -> None:
        use = self._uses.get(future)
        if use is None:
            return
        key = use[0]
        use[1] -= 1
        if use[1] == 0:
            del self._uses[future]
        entry = self._holders[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.num_bytes -= entry[1]
            del self._holders[key]


@dataclass(eq=False)
class _Job:
    key: str
    kind: str
    source: str
    future: Future
    holders: int = 1  # requests waiting for it
    state: str = _QUEUED


def _injected_delay() -> float:
    """VSERVE_FAULT_INJECT="grammar_compile_delay:SECONDS": slow compiles (a test hook)."""
    from vserve.envs import read_env

    spec = read_env().fault_inject or ""
    return float(spec.split(":", 1)[1]) if spec.startswith("grammar_compile_delay:") else 0.0
