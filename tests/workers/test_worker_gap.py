"""The worker loop's gap between two steps (workers/worker_proc.py `_between_steps`): the step's
held reply goes out first, then the next request is taken and, parked, its inputs prepared; a
reply that cannot be made or a request that does not decode comes back as the failure of a
step (reported to the engine), not as the engine core's disappearance."""

from vserve.core.sched_output import RunnerOutput, SchedulerOutput
from vserve.workers import messages as wire
from vserve.workers import worker_proc


class _Conn:
    def __init__(self, requests: list[bytes]) -> None:
        self.requests = requests

    def poll(self, timeout: float) -> bool:
        return bool(self.requests)

    def recv_bytes(self) -> bytes:
        if not self.requests:
            raise EOFError
        return self.requests.pop(0)


class _Out:
    def __init__(self, value=None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value


def _loop(requests: list[bytes]):
    loop = object.__new__(worker_proc._RankLoop)
    loop.rank, loop.world, loop.pp, loop.prefetch, loop.busy = 0, 1, None, None, True
    loop.req_conn = _Conn(requests)
    loop.sent, loop.prepared, loop.events = [], [], []

    def send(reply: bytes) -> None:
        loop.sent.append(reply)
        loop.events.append("reply")

    def prepare(so) -> None:
        loop.prepared.append(so.step_id)
        loop.events.append("prepare")

    loop._send = send
    loop.worker = type("W", (), {"prepare": lambda self, so: prepare(so)})()
    loop.gap = type("G", (), {"wake": lambda self: loop.events.append("wake")})()
    loop.held_reply = None
    return loop


def _execute(step_id: int) -> bytes:
    return wire.encode(wire.Execute(SchedulerOutput.empty(step_id, set(), set())))


def test_held_reply_goes_out_before_the_next_request_is_taken():
    loop = _loop([_execute(8)])
    loop.held_reply = _Out(RunnerOutput(step_id=7))
    msg, hidden = loop._between_steps(parked=True)
    assert isinstance(msg, wire.Execute) and msg.so.step_id == 8 and hidden is None
    assert [wire.decode_reply(b).output.step_id for b in loop.sent] == [7]
    assert loop.prepared == [8] and loop.held_reply is None
    loop.req_conn.requests.append(_execute(9))
    loop._between_steps(parked=False)  # not parked: its inputs are made by the step itself
    assert loop.prepared == [8] and len(loop.sent) == 1


def test_a_parked_team_wakes_when_the_preparation_begins():
    """The team is woken after the reply went out and before the inputs are made, so its
    wake-up runs under the preparation instead of delaying the forward (host_gap.py)."""
    loop = _loop([_execute(8), _execute(9)])
    loop.held_reply = _Out(RunnerOutput(step_id=7))
    loop._between_steps(parked=True)
    assert loop.events == ["reply", "wake", "prepare"]
    loop.events.clear()
    loop._between_steps(parked=False)  # not parked: no team to wake, nothing prepared
    assert loop.events == []


def test_a_reply_that_fails_is_the_steps_failure():
    loop = _loop([_execute(8)])
    loop.held_reply = _Out(error=ValueError("logprobs"))
    msg, _ = loop._between_steps(parked=True)
    assert isinstance(msg, ValueError) and loop.sent == []
    assert loop.req_conn.requests  # the next request stays for after the report


def test_a_request_that_does_not_decode_is_reported():
    loop = _loop([b"\x93garbage"])
    msg, _ = loop._between_steps(parked=True)
    assert isinstance(msg, wire.MessageError)
