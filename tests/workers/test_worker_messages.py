"""Messages between the engine core and the worker ranks are typed msgspec structs: every kind
round-trips, and bytes another host could send (garbage, a pickle that would run a command, a
message of the wrong direction) raise a clean error and run nothing."""

import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest

from vserve.core.outputs import LogprobsDelta
from vserve.core.sched_output import (
    CachedRequestData,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    StepTiming,
)
from vserve.executor.multiproc import MultiprocExecutor, WorkerError
from vserve.sampling_params import SamplingParams, StructuredOutputsParams
from vserve.workers import messages as wire


def _so(bitmask=None) -> SchedulerOutput:
    sp = SamplingParams(
        temperature=0.7,
        top_k=5,
        seed=3,
        stop=["x"],
        logit_bias={4: 1.5},
        structured_outputs=StructuredOutputsParams(regex="[ab]+"),
    )
    new = NewRequestData("a", 2, [1, 2, 3], 2, sp, 7, [0], ([4, 5],), 1)
    return SchedulerOutput(
        9,
        [new],
        CachedRequestData(["b"], [([6],)], [8]),
        {"a": 2, "b": 1},
        3,
        {"a": 2, "b": 0},
        {"a", "b"},
        {"c"},
        {"d"},
        {"b": [5, 6]},
        ["a"],
        True,
        bitmask,
    )


def _same_so(a: SchedulerOutput, b: SchedulerOutput) -> bool:
    ma, mb = a.grammar_bitmask, b.grammar_bitmask
    same_mask = (ma is None and mb is None) or (
        isinstance(mb, np.ndarray) and mb.dtype == np.int32 and np.array_equal(ma, mb)
    )
    a.grammar_bitmask = b.grammar_bitmask = None
    try:
        return same_mask and a == b
    finally:
        a.grammar_bitmask, b.grammar_bitmask = ma, mb


BITMASK = np.array([[-1, 7, 0], [1 << 30, -(1 << 31), 5]], dtype=np.int32)


@pytest.mark.parametrize("bitmask", [None, BITMASK])
def test_execute_round_trips(bitmask):
    for defer in (False, True):
        got = wire.decode_request(wire.encode(wire.Execute(_so(bitmask), defer)))
        assert isinstance(got, wire.Execute) and got.defer_sampling is defer
        assert _same_so(got.so, _so(bitmask))
        assert type(got.so.scheduled_new_reqs[0].sampling_params) is SamplingParams
        assert got.so.sampling_req_ids == {"a", "b"}


@pytest.mark.parametrize(
    "msg",
    [
        wire.Sample(4, None),
        wire.Place({0: (2, 2, (0, 1)), 1: (1, 2, ())}),
        wire.Load(),
        wire.NumKvBlocks(),
        wire.InitKvCache(123),
        wire.Shutdown(),
    ],
)
def test_control_requests_round_trip(msg):
    assert wire.decode_request(wire.encode(msg)) == msg


def test_sample_bitmask_round_trips_as_int32_array():
    got = wire.decode_request(wire.encode(wire.Sample(4, BITMASK)))
    assert got.step_id == 4 and got.grammar_bitmask.dtype == np.int32
    assert np.array_equal(got.grammar_bitmask, BITMASK)
    got.grammar_bitmask[0, 0] = 3  # writable, as torch.as_tensor wants
    empty = wire.decode_request(wire.encode(wire.Sample(5, np.zeros((0, 4), np.int32))))
    assert empty.grammar_bitmask.shape == (0, 4)


@pytest.mark.parametrize(
    "msg",
    [
        wire.Out(
            RunnerOutput(
                3,
                ["a", "b"],
                [[1, 2], [7]],
                [LogprobsDelta([[1, 4]], [[-0.5, -1.0]], [1]), None],
                StepTiming(1.0, 2.0, 3.0, 4.0, [(1.0, 2.0), (2.5, 3.0)]),
            )
        ),
        wire.Out(
            RunnerOutput(
                4, prompt_logprobs={"a": (1, LogprobsDelta([[5, 6]], [[-2.0, -0.1]], [2]))}
            )
        ),
        wire.Out(RunnerOutput(4)),
        wire.Ok(None),
        wire.Ok(77),
        wire.Error("rank 1: boom"),
    ],
)
def test_replies_round_trip(msg):
    assert wire.decode_reply(wire.encode(msg)) == msg


class _RunsCommand:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _forged(tmp_path) -> dict[str, bytes]:
    marker = tmp_path / "pwned"
    evil = pickle.dumps(("out", _RunsCommand(str(marker))))
    return {
        "pickle": evil,
        "pickle-request": pickle.dumps(("execute", _RunsCommand(str(marker)), False)),
        "garbage": b"\xc1\x00\xff garbage",
        "empty": b"",
        "truncated": wire.encode(wire.Execute(_so(BITMASK)))[:-5],
        "wrong-tag": wire.encode(wire.Ok(1)).replace(b"ok", b"xx"),
        "wrong-type": wire.encode(wire.InitKvCache(5)).replace(b"\x05", b"\xa1x"),
        "bad-ext": wire.encode(wire.Sample(1, BITMASK))[:-4],
    }


def test_forged_payloads_raise_and_run_nothing(tmp_path):
    for name, data in _forged(tmp_path).items():
        for decode in (wire.decode_request, wire.decode_reply):
            with pytest.raises(wire.MessageError, match="invalid worker"):
                decode(data)
    assert not (tmp_path / "pwned").exists()
    # one direction's message is not the other's
    with pytest.raises(wire.MessageError):
        wire.decode_request(wire.encode(wire.Ok(1)))
    with pytest.raises(wire.MessageError):
        wire.decode_reply(wire.encode(wire.Load()))
    # a bitmask slot holding anything but a bitmask (an int32 ndarray)
    with pytest.raises(wire.MessageError, match="ndarray"):
        wire.decode_request(wire.encode(wire.Sample(1, [[1, 2]])))


def test_engine_turns_a_forged_reply_into_a_worker_error(tmp_path):
    """The engine core's reply path (what the last rank, possibly on another host, sends
    through rank 0): a pickle that would run a command is a WorkerError, and runs nothing."""
    ex = object.__new__(MultiprocExecutor)  # the reply path only: no worker processes
    ex.procs, ex.replies, ex.watchdog_timeout = [], {}, 0.0
    ex._sent_at, ex._last_reply_at, ex._closing = {}, 0.0, False
    ex.resp_r, resp_w = mp.Pipe(duplex=False)
    resp_w.send_bytes(_forged(tmp_path)["pickle"])
    with pytest.raises(WorkerError, match="invalid worker reply"):
        ex._reply_for(1, 5.0)
    assert not (tmp_path / "pwned").exists()
    resp_w.send_bytes(wire.encode(wire.Out(RunnerOutput(1, ["a"], [[3]]))))
    assert ex._reply_for(1, 5.0).sampled_token_ids == [[3]]
