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
    """One ADD frame: the engine requests of one prompt (its `n` children). Their shared
    structured-output constraint, which may be long, crosses once (`constraint`); their own
    params carry none on the wire (`pack_requests`, `unpack_requests`)."""

    requests: list[EngineCoreRequest]
    constraint: StructuredOutputsParams | None = None


def pack_requests(requests: list[EngineCoreRequest]) -> EngineCoreRequests:
    constraint = requests[0].sampling_params.structured_outputs
    if constraint is None or any(
        r.sampling_params.structured_outputs is not constraint for r in requests
    ):
        return EngineCoreRequests(list(requests))
    bare: dict[int, SamplingParams] = {}  # children share their params object: strip it once
    out = []
    for r in requests:
        params = r.sampling_params
        if id(params) not in bare:
            bare[id(params)] = params.clone(structured_outputs=None)
        out.append(msgspec.structs.replace(r, sampling_params=bare[id(params)]))
    return EngineCoreRequests(out, constraint)


def unpack_requests(group: EngineCoreRequests) -> list[EngineCoreRequest]:
    """The requests of a decoded ADD frame, each holding the one decoded constraint."""
    if group.constraint is not None:
        for r in group.requests:
            r.sampling_params.structured_outputs = group.constraint
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


class RequestType(enum.IntEnum):
    ADD = 0
    ABORT = 1
    UTILITY = 2
    SHUTDOWN = 3
