"""Wire types between the front end and the engine core (msgpack through msgspec).

Structs are `array_like` and `omit_defaults`: compact, and nothing is ever unpickled. Token
ids travel as deltas: each `EngineCoreOutput` carries only the tokens confirmed by one step.
What the scheduler reports (`EngineCoreOutput`, `LogprobsDelta`, `SchedulerStats`) is defined
in `vserve.core.outputs`, the layer that makes it; this module is the wire around it.
"""

from __future__ import annotations

import enum

import msgspec

from vserve.core.outputs import EngineCoreOutput, LogprobsDelta, SchedulerStats
from vserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "FRAME_DEAD",
    "FRAME_OUTPUTS",
    "FRAME_READY",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreRequests",
    "LogprobsDelta",
    "RequestType",
    "SchedulerStats",
]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    sampling_seed: int
    arrival_time: float = 0.0
    cache_salt: str | None = None
    # the front end's number for this request (unique per front end): its outputs echo it,
    # so a late output of an aborted request never reaches a new request of the same id
    incarnation: int = 0


class EngineCoreRequests(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One ADD frame: the engine requests of one prompt (its `n` children). What they share
    and may be long crosses once: the prompt's token ids and the structured-output
    constraint; their own fields carry neither on the wire (`pack_requests`,
    `unpack_requests`)."""

    requests: list[EngineCoreRequest]
    constraint: StructuredOutputsParams | None = None
    prompt_token_ids: list[int] | None = None


def pack_requests(requests: list[EngineCoreRequest]) -> EngineCoreRequests:
    first = requests[0]
    prompt: list[int] | None = first.prompt_token_ids
    constraint = first.sampling_params.structured_outputs
    if len(requests) == 1 or any(r.prompt_token_ids is not prompt for r in requests):
        prompt = None  # one request, or no shared list: each carries its own
    if any(r.sampling_params.structured_outputs is not constraint for r in requests):
        constraint = None
    if prompt is None and constraint is None:
        return EngineCoreRequests(list(requests))
    bare: dict[int, SamplingParams] = {}  # children share their params object: strip it once
    out = []
    for r in requests:
        params = r.sampling_params
        if constraint is not None and id(params) not in bare:
            bare[id(params)] = params.clone(structured_outputs=None)
        changes: dict = {"sampling_params": bare.get(id(params), params)}
        if prompt is not None:
            changes["prompt_token_ids"] = []
        out.append(msgspec.structs.replace(r, **changes))
    return EngineCoreRequests(out, constraint, prompt)


def unpack_requests(group: EngineCoreRequests) -> list[EngineCoreRequest]:
    """The requests of a decoded ADD frame, each holding the one decoded constraint and
    prompt."""
    for r in group.requests:
        if group.constraint is not None:
            r.sampling_params.structured_outputs = group.constraint
        if group.prompt_token_ids is not None:
            r.prompt_token_ids = group.prompt_token_ids
    return group.requests


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_call_id: int = -1
    utility_result: bytes | None = None
    engine_error: str | None = None  # fatal: the engine core is dead
    # the data-parallel rank of the engine that sent it: set by the client that received it
    # (it knows which engine it talks to), never taken from the wire
    engine_index: int = 0


# engine core -> front end: the first frame of each message (the second is its payload)
FRAME_READY, FRAME_OUTPUTS, FRAME_DEAD = b"R", b"O", b"D"


class RequestType(enum.IntEnum):
    ADD = 0
    ABORT = 1
    UTILITY = 2
    SHUTDOWN = 3
