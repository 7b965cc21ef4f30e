"""Wire types between the engine core and the worker ranks (msgpack through msgspec).

Requests go from the engine core to rank 0, which passes the same bytes on to every other rank
over torch.distributed; each step's reply comes from the last rank through rank 0 back to the
engine core. Those bytes may come from another host, so nothing here is ever unpickled: every
message decodes into one of the typed structs below or raises `MessageError`. The grammar
bitmask (an int32 ndarray) travels as a msgpack extension and decodes to an int32 ndarray only.
"""

from __future__ import annotations

import msgspec
import numpy as np

from vserve.core.sched_output import RunnerOutput, SchedulerOutput

_BITMASK_EXT = 1


class MessageError(ValueError):
    """Bytes that are not a valid worker message."""


# -- engine core -> ranks --------------------------------------------------------------------------
class Execute(msgspec.Struct, tag="execute", array_like=True):
    so: SchedulerOutput
    defer_sampling: bool = False


class Sample(msgspec.Struct, tag="sample", array_like=True):
    """Sampling of a deferred step, with the grammar bitmask known only now."""

    step_id: int
    grammar_bitmask: np.ndarray | None = None  # int32 [rows, words]


class Place(msgspec.Struct, tag="place", array_like=True):
    # rank -> (torch threads, threads in prompt-heavy steps, CPUs)
    per_rank: dict[int, tuple[int, int, tuple[int, ...]]]


class Load(msgspec.Struct, tag="load", array_like=True):
    pass


class NumKvBlocks(msgspec.Struct, tag="num_kv_blocks", array_like=True):
    pass


class InitKvCache(msgspec.Struct, tag="init_kv_cache", array_like=True):
    num_blocks: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


WorkerRequest = Execute | Sample | Place | Load | NumKvBlocks | InitKvCache | Shutdown


# -- ranks -> engine core --------------------------------------------------------------------------
class Out(msgspec.Struct, tag="out", array_like=True):
    output: RunnerOutput


class Ok(msgspec.Struct, tag="ok", array_like=True):
    value: int | None = None


class Error(msgspec.Struct, tag="error", array_like=True):
    message: str


WorkerReply = Out | Ok | Error


# -- codec -----------------------------------------------------------------------------------------
def _enc_hook(obj):
    if isinstance(obj, np.ndarray) and obj.ndim == 2 and obj.dtype == np.int32:
        header = np.array([obj.shape[0], obj.shape[1]], dtype="<u4").tobytes()
        return msgspec.msgpack.Ext(_BITMASK_EXT, header + obj.astype("<i4", copy=False).tobytes())
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the workers")


def _ext_hook(code: int, data: memoryview):
    if code != _BITMASK_EXT or len(data) < 8:
        raise ValueError(f"unknown extension type {code}")
    rows, words = (int(x) for x in np.frombuffer(data[:8], dtype="<u4"))
    if len(data) != 8 + 4 * rows * words:
        raise ValueError(f"bitmask of {rows} x {words} words has {len(data) - 8} bytes")
    return np.frombuffer(data[8:], dtype="<i4").astype(np.int32).reshape(rows, words)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_request_decoder = msgspec.msgpack.Decoder(WorkerRequest, ext_hook=_ext_hook)
_reply_decoder = msgspec.msgpack.Decoder(WorkerReply, ext_hook=_ext_hook)


def encode(msg: WorkerRequest | WorkerReply) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> WorkerRequest:
    """A typed request; a bitmask slot holding anything but an ndarray fails to decode."""
    return _decode(_request_decoder, data, "request")


def decode_reply(data: bytes) -> WorkerReply:
    return _decode(_reply_decoder, data, "reply")


def _decode(decoder, data: bytes, what: str):
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise MessageError(f"invalid worker {what} ({len(data)} bytes): {e}") from None
