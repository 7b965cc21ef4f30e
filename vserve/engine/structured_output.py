"""Structured output with xgrammar: compile grammars off the busy loop, within a budget, once
per distinct constraint; keep one matcher per request, and fill token bitmasks for the rows
that sample.

Grammars compile off the busy loop (`StructuredOutputManager`); a request waits in the queue
until its grammar is ready, so the busy loop never compiles. A matcher advances only
on confirmed tokens (the scheduler's commit), never on in-flight ones: a preempted request's
matcher is therefore already where its recomputation starts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from vserve.config import StructuredOutputConfig
from vserve.core.outputs import ERROR_BUSY, ERROR_INVALID, RequestError
from vserve.core.structured import GrammarMatcher
from vserve.engine.grammar_worker import CompileWorker, Job
from vserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # imported when first used
    import xgrammar as xgr

logger = logging.getLogger("vserve.engine")

MAX_SCHEMA_DEPTH = 128  # nesting of a JSON schema; compile time grows ~ depth**3


class GrammarState:
    """One request's matcher."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
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
        self._worker: CompileWorker | None = None
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # digest -> the job of every request waiting for it
        self._of_future: dict[Future, _Job] = {}
        self._queue: deque[_Job] = deque()
        self._wake = threading.Condition(self._lock)
        self._cache = BytesLRU(self.CACHE_BYTES)
        self._local = ThreadPoolExecutor(1, thread_name_prefix="vserve-grammar")
        self._thread: threading.Thread | None = None
        self._closed = False
        self._compiled = threading.Event()  # a compile finished since the last wait
        self.on_compiled: Callable[[], None] | None = None  # the engine core's wake-up
        self._compile_delay = _injected_delay()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, params: StructuredOutputsParams) -> Future:
        kind, source = grammar_source(params)
        key = constraint_digest(kind, source)
        with self._lock:
            job = self._jobs.get(key)
            if job is not None:
                job.holders += 1
                return job.future
            future: Future = Future()
            compiled = self._cache.get(key)
            if compiled is not None:
                future.set_result(compiled)
            elif len(self._jobs) >= self.MAX_PENDING_COMPILES:
                future.set_exception(
                    RequestError(
                        f"structured outputs: {self.MAX_PENDING_COMPILES} grammars are "
                        "compiling; retry later",
                        ERROR_BUSY,
                    )
                )
            else:
                job = _Job(key, kind, source, future)
                self._jobs[key] = self._of_future[future] = job
                self._queue.append(job)
                self._start()
                self._wake.notify()
        future.add_done_callback(self._done)
        return future

    def release(self, compiling: Future) -> None:
        kill = False
        with self._lock:
            job = self._of_future.get(compiling)
            if job is None:
                return
            job.holders -= 1
            if job.holders > 0:
                return
            if job.state == _QUEUED:
                self._queue.remove(job)
                self._forget(job)
                job.future.cancel()
            elif job.state == _TRIAL:
                job.state, kill = _ABANDONED, True
        if kill and self._worker is not None:
            self._worker.kill()

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
    def new_state(self, compiled) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

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
            if job.state == _ABANDONED:
                self._forget(job)
                job.future.cancel()
                return
            job.state = _LOCAL
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
        self._cache.put(job.key, compiled, compiled.memory_size_bytes or size)
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
            self._get_compiler()
            info = self._info.serialize_json()
            self._worker = CompileWorker(info, self.config.compile_memory_mb)
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


@dataclass(eq=False)
class _Job:
    key: str
    kind: str
    source: str
    future: Future
    holders: int = 1  # requests waiting for it
    state: str = _QUEUED


class BytesLRU:
    """Least recently used values, at most `max_bytes` of them by their given sizes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str):
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, value, size: int) -> None:
        if size > self.max_bytes:
            return  # bigger than the whole cache: used once, never kept
        with self._lock:
            old = self._items.pop(key, None)
            self.num_bytes += size - (old[1] if old else 0)
            self._items[key] = (value, size)
            while self.num_bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.num_bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)


def compile_source(compiler, kind: str, source: str):
    """xgrammar's compiled grammar for a constraint (`grammar_source`'s kind and text)."""
    if kind == "json":
        return compiler.compile_grammar(json_schema_grammar(source))
    if kind == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(source)


def constraint_digest(kind: str, source: str) -> str:
    """The key of a constraint in every cache (never its text, which may be long)."""
    data = source.encode("utf-8", "surrogatepass")
    return hashlib.sha256(kind.encode() + b"\0" + data).hexdigest()


def _injected_delay() -> float:
    """VSERVE_FAULT_INJECT="grammar_compile_delay:SECONDS": slow compiles (a test hook)."""
    from vserve.envs import read_env

    spec = read_env().fault_inject or ""
    return float(spec.split(":", 1)[1]) if spec.startswith("grammar_compile_delay:") else 0.0


def grammar_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """What xgrammar builds for a constraint: ("json" | "regex" | "ebnf", its text)."""
    kind, value = params.key
    if kind == "json_object":
        return "json", '{"type": "object"}'
    if kind == "choice":
        assert params.choice is not None  # what `key` said
        return "regex", "|".join(_regex_escape(c) for c in params.choice)
    return ("ebnf", value) if kind == "grammar" else (kind, value)


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ValueError for a constraint that cannot compile (an invalid regex, schema or
    grammar, or a schema nested too deep), before the request is admitted. It parses the
    constraint without the tokenizer (milliseconds; the engine's compile takes longer) and
    remembers, by digest, what passed. Thread-safe: the server runs it off its event loop."""
    kind, source = grammar_source(params)
    key = constraint_digest(kind, source)
    if _passed.get(key) is None:
        _check_source(kind, source)
        _passed.put(key, True, 1)


_passed = BytesLRU(4096)  # digests of constraints that parsed


def xgrammar_reason(e: BaseException) -> str:
    """What an xgrammar error says is wrong, without its source file and time stamp."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return text.splitlines()[-1].split("] ", 1)[-1].split(": ", 1)[-1][:300]


# xgrammar (0.2.9) writes a string with minLength / maxLength as a bounded repeat of this
# character class: it lets raw control characters in (JSON parsers refuse them) and escapes out.
_BOUNDED_CLASS = r"[^\"\\\r\n]"
_BOUNDED_STRING_CHAR = f"(({_BOUNDED_CLASS}))"
# what a JSON string character is: anything but a control character, quote or backslash, or
# an escape (one character of the string, as minLength / maxLength count it)
_JSON_STRING_CHAR = r'(([^\0-\x1f\"\\]) | ("\\" vserve_json_escape))'
_JSON_ESCAPE_RULE = (
    r"vserve_json_escape ::= (([\"\\/bfnrt]) | "
    r'("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
)


def json_schema_grammar(source: str):
    """The grammar of a JSON schema's compact JSON (a weak model cannot wander off into
    endless whitespace), with the length-bounded strings mended to JSON's string rules."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
    lines = str(grammar).splitlines()
    bad = " ::= " + _BOUNDED_STRING_CHAR
    mended = [
        line[: -len(_BOUNDED_STRING_CHAR)] + _JSON_STRING_CHAR if line.endswith(bad) else line
        for line in lines
    ]
    if any(_BOUNDED_CLASS in line for line in mended):  # the class in another form
        _warn_unmended()
    if mended == lines:
        return grammar
    return xgr.Grammar.from_ebnf("\n".join([*mended, _JSON_ESCAPE_RULE]))


@functools.lru_cache(maxsize=1)
def _warn_unmended() -> None:
    from importlib.metadata import version

    logger.warning(
        "xgrammar %s wrote the length-bounded string class in a form vserve does not mend: "
        "such strings may admit raw control characters (invalid JSON)",
        version("xgrammar"),
    )


def _check_source(kind: str, source: str) -> None:
    import xgrammar as xgr

    if kind == "json" and _depth(_json_value(source)) > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"structured outputs: the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
        )
    builds: dict[str, Callable[[str], Any]] = {
        "json": json_schema_grammar,
        "regex": xgr.Grammar.from_regex,
        "ebnf": xgr.Grammar.from_ebnf,
    }
    build = builds[kind]
    try:
        build(source)
    except UnicodeError:
        raise ValueError("structured outputs: the constraint is not valid Unicode") from None
    except RuntimeError as e:  # xgrammar's parse errors; the last line says what is wrong
        reason = xgrammar_reason(e)
        name = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar"}[kind]
        raise ValueError(f"structured outputs: invalid {name}: {reason}") from None


def _json_value(source: str):
    try:
        return json.loads(source)
    except RecursionError:
        raise ValueError(
            f"structured outputs: the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
        ) from None
    except ValueError as e:
        raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {e}") from None


def _depth(value, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """Nesting depth of a JSON value, counted up to `limit` (no deeper recursion)."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def _regex_escape(text: str) -> str:
    special = set("\\.^$|?*+()[]{}")
    return "".join("\\" + c if c in special else c for c in text)
