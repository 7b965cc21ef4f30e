"""The scheduler's view of one request: its tokens, its counters and its lifecycle.

Counters:

| name                     | meaning                                                   |
|--------------------------|-----------------------------------------------------------|
| N  `num_tokens`          | prompt + confirmed output tokens (ids known on the CPU)    |
| C  `num_computed_tokens` | positions whose KV is written or being written (advanced   |
|                          | when a step is scheduled)                                  |
| PH `num_output_placeholders` | outputs reserved by in-flight steps, not yet confirmed  |
| D  = N + PH - C          | known-but-uncomputed tokens; unchanged by schedule/commit  |

`epoch` is a scheduler-wide unique number given at every admission (first or after a
preemption). A step records the epoch of each request it carries; an output whose epoch is
not the request's current one is stale and is dropped.
"""

from __future__ import annotations

import enum
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vserve.core.outputs import LogprobsDelta
from vserve.core.structured import GrammarMatcher
from vserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    sampling_seed: int = 0
    cache_salt: str | None = None
    arrival_time: float = 0.0

    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_computed_tokens: int = field(init=False, default=0)
    num_output_placeholders: int = field(init=False, default=0)
    epoch: int = field(init=False, default=-1)
    inflight_step_ids: deque[int] = field(init=False, default_factory=deque)
    num_cached_tokens: int = field(init=False, default=-1)
    num_preemptions: int = field(init=False, default=0)
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    stop_reason: int | str | None = field(init=False, default=None)
    grammar_future: Future | None = field(init=False, default=None)  # compiling
    grammar: GrammarMatcher | None = field(init=False, default=None)  # once compiled
    error: str | None = field(init=False, default=None)
    error_kind: str | None = field(init=False, default=None)  # see core.outputs.RequestError
    add_seq: int = field(init=False, default=0)  # engine core arrival number (aborts)
    incarnation: int = field(init=False, default=0)  # the front end's number, echoed
    # prompt logprobs: entries for prompt tokens 1..num_prompt_logprobs-1 have arrived; those
    # not yet sent wait in `prompt_logprobs` for the request's first output
    num_prompt_logprobs: int = field(init=False, default=1)
    prompt_logprobs: LogprobsDelta | None = field(init=False, default=None)
    # an embedding (sampling_params.pooling): the prefill chunks' pooled rows, summed
    pool_sum: np.ndarray | None = field(init=False, default=None)
    pool_count: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed(self) -> int:
        """D = N + PH - C: tokens known (or reserved) but not yet scheduled."""
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def use_grammar(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
