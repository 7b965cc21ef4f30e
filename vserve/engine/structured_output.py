"""Structured output with xgrammar: compile grammars off the busy loop, keep one matcher per
request, and fill token bitmasks for the rows that sample.

Grammars compile on a small thread pool (xgrammar caches them per schema); a request waits in
the queue until its grammar is ready, so the busy loop never compiles. A matcher advances only
on confirmed tokens (the scheduler's commit), never on in-flight ones: a preempted request's
matcher is therefore already where its recomputation starts.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from vserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("vserve.engine")


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
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_workers: int = 2) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="vserve-grammar")
        self._compiler = None
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        return self._pool.submit(self._compile, params)

    def new_state(self, compiled) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.vocab_size).numpy()

    def fill(self, state: GrammarState, bitmask: np.ndarray, row: int) -> None:
        import torch

        state.fill(torch.from_numpy(bitmask), row)

    # -- compile -----------------------------------------------------------------------------------
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                from vserve.tokenizer import load_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(
                    load_tokenizer(self.tokenizer_path), vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind, value = params.key
        if kind == "json":
            # compact JSON: a weak model cannot wander off into endless whitespace
            return compiler.compile_json_schema(value, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "choice":
            return compiler.compile_regex("|".join(_regex_escape(c) for c in params.choice))
        return compiler.compile_grammar(value)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _regex_escape(text: str) -> str:
    special = set("\\.^$|?*+()[]{}")
    return "".join("\\" + c if c in special else c for c in text)
