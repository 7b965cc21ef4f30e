"""Structured output with xgrammar: compile grammars off the busy loop, keep one matcher per
request, and fill token bitmasks for the rows that sample.

Grammars compile on a small thread pool (xgrammar caches them per schema); a request waits in
the queue until its grammar is ready, so the busy loop never compiles. A matcher advances only
on confirmed tokens (the scheduler's commit), never on in-flight ones: a preempted request's
matcher is therefore already where its recomputation starts.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from vserve.core.structured import GrammarMatcher
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
    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_workers: int = 2,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="vserve-grammar"
        )
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._compiled = threading.Event()  # a compile finished since the last wait
        self.on_compiled: Callable[[], None] | None = None  # the engine core's wake-up
        self._compile_delay = _injected_delay()

    def submit(self, params: StructuredOutputsParams) -> Future:
        future = self._pool.submit(self._compile, params)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Future) -> None:
        self._compiled.set()
        if self.on_compiled is not None:
            self.on_compiled()

    def wait_compiled(self, timeout: float) -> None:
        """Block until a compile finishes (or `timeout`): while only compiling requests
        wait, a step would be empty, so the loop sleeps here instead of spinning."""
        self._compiled.wait(timeout)
        self._compiled.clear()

    def new_state(self, compiled) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.vocab_size).numpy()

    def fill(self, state: GrammarMatcher, bitmask: np.ndarray, row: int) -> None:
        import torch

        cast(GrammarState, state).fill(torch.from_numpy(bitmask), row)  # made by new_state

    # -- compile -----------------------------------------------------------------------------------
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                from vserve.tokenizer import load_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(
                    load_tokenizer(self.tokenizer_path),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams):
        if self._compile_delay:
            time.sleep(self._compile_delay)
        compiler = self._get_compiler()
        kind, source = grammar_source(params)
        if kind == "json":
            return compiler.compile_grammar(json_schema_grammar(source))
        if kind == "regex":
            return compiler.compile_regex(source)
        return compiler.compile_grammar(source)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
    remembers what passed (small ones). Thread-safe: the server runs it off its event loop."""
    kind, source = grammar_source(params)
    check = _check_source_cached if len(source) <= _MAX_CACHED_SOURCE else _check_source
    check(kind, source)


_MAX_CACHED_SOURCE = 64 * 1024  # the cache holds at most 256 x 64 KB


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


@functools.lru_cache(maxsize=64)
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

    if kind == "json" and _depth(json.loads(source)) > MAX_SCHEMA_DEPTH:
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
    except RuntimeError as e:  # xgrammar's parse errors; the last line says what is wrong
        reason = str(e).strip().splitlines()[-1].split("] ", 1)[-1].split(": ", 1)[-1]
        name = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar"}[kind]
        raise ValueError(f"structured outputs: invalid {name}: {reason}") from None


_check_source_cached = functools.lru_cache(maxsize=256)(_check_source)


def _depth(value, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """Nesting depth of a JSON value, counted up to `limit` (no deeper recursion)."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def _regex_escape(text: str) -> str:
    special = set("\\.^$|?*+()[]{}")
    return "".join("\\" + c if c in special else c for c in text)
