"""What the scheduler needs of structured output: a matcher per request and bitmasks per step.

The engine's `StructuredOutputManager` (xgrammar) implements these; the scheduler sees only
the protocols, so the core imports neither xgrammar nor torch, and tests pass fakes.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class GrammarMatcher(Protocol):
    """One request's matcher: it advances on confirmed tokens only."""

    def accept(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


class StructuredOutputs(Protocol):
    def new_state(self, compiled: Any, starts_after: str | None = None) -> GrammarMatcher:
        """A matcher of `compiled`; with `starts_after`, one that allows every token (and
        advances no grammar) until the output has written that text."""
        ...

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """int32 [num_rows, ceil(vocab / 32)], every token allowed."""
        ...

    def fill(self, state: GrammarMatcher, bitmask: np.ndarray, row: int) -> None: ...

    def release(self, compiling: Any) -> None:
        """A request that waited for (or used) this compile is done with it: a compile that
        no request waits for any more is cancelled."""
        ...
