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
from vserve.sampling_params import SamplingParams

__all__ = [
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
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
