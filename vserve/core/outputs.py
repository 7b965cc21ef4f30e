"""What the scheduler reports: per request, the tokens one step confirmed (with their logprobs,
a finish reason or an error), and per step, the scheduler's figures.

These are the core layer's output types; the engine sends them to the front end as they are
(`vserve.engine.messages` wraps them in `EngineCoreOutputs`). msgpack through msgspec:
`array_like` and `omit_defaults`, nothing is ever unpickled.
"""

from __future__ import annotations

import msgspec

# why a request failed, when it was the request's own doing (None: the engine's)
ERROR_INVALID = "invalid"  # its input cannot be served as asked (HTTP 400)
ERROR_BUSY = "busy"  # the engine cannot take it now; a retry may succeed (HTTP 503)
ERROR_DEAD = "dead"  # the engine that ran it died (data parallel serving on: HTTP 500)


class RequestError(Exception):
    """A failure that belongs to one request, with its kind (`ERROR_INVALID`, `ERROR_BUSY`);
    the message is the engine's own words, fit for the client."""

    def __init__(self, message: str, kind: str = ERROR_INVALID) -> None:
        super().__init__(message)
        self.kind = kind


class LogprobsDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per confirmed token: ids and logprobs, the sampled token first, then the top-N."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsDelta | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # prompt tokens 1.. (index 0 has none), sent once, with the first token
    prompt_logprobs: LogprobsDelta | None = None
    incarnation: int = 0  # the request's (EngineCoreRequest.incarnation)
    error_kind: str | None = None  # ERROR_INVALID, _BUSY, _DEAD; None: the engine's failure
    embedding: bytes | None = None  # SamplingParams.pooling: the vector, fp32 little-endian

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative tokens looked up
    prefix_cache_hits: int = 0  # cumulative tokens hit
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # this step: prompt tokens scheduled
    num_generation_tokens: int = 0  # this step: tokens confirmed
    step_id: int = 0
    # steps committed since the previous stats message (overlap figures), seconds
    forward_times: list[float] = []  # device forward time of each step
    launch_intervals: list[float] = []  # time from the previous step's launch to this one's
    schedule_times: list[float] = []  # scheduler busy time of each step
    schedule_exposed: list[float] = []  # part of it that no forward was running under
    no_overlap_steps: dict[str, int] = {}  # steps launched with none in flight, by reason
    spec_num_drafts: int = 0  # cumulative: speculative steps, draft tokens, accepted
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    triton_compiles: int = 0  # cumulative: Triton compiles in the workers after start-up
