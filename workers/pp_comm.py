"""Communication of the TP x PP grid over torch.distributed.

Ranks are placed by `vserve.distributed.grid.GridRank` (rank = pp_rank * tp + tp_rank). Each
TP column is a pipeline of its own: stage to stage, hidden states go between the ranks of
equal TP rank (the hidden states after an all-reduce are the same on every TP rank). Requests
enter at rank 0, which passes them to its TP peers and down its column; every other rank takes
them from the rank before it (`GridRank.request_source`). The sampling rank (TP rank 0 of the
last stage) sends the sampled ids to every first-stage rank and each step's reply to rank 0.
The TP group of the stage (`tp`, a `TPComm`) is built here too, after the groups below.

Process groups, so that traffic of different kinds never interleaves:

* chain (gloo): each request rank 0 receives from the engine core travels down the pipeline,
  rank to rank, sent without waiting: a stage never waits for a later stage to take a request
  (a gloo broadcast would hold rank 0 until every rank joined it, so the stages took turns);
  on CUDA, with each step's hidden states, the (start, end) forward spans of the stages before
  (on CPU they ride in the hidden states' message), so the last stage's reply carries every
  stage's forward (the overlap report's per-stage figures);
* control (gloo): start-up collectives (the smallest KV cache over ranks);
* reply (gloo): the last stage sends each step's result back to rank 0, which forwards it
  to the engine core (so only rank 0 talks to the engine, even across hosts);
* data (gloo on CPU, nccl on CUDA): hidden states stage to stage, and the sampled ids from
  the last stage back to stage 0 for the on-device token feedback;
* spans (gloo, CUDA only): the forward spans beside the hidden states.

Every receive is posted before its message is sent wherever the receiver can know its size
early. Gloo moves a message only once its receive is posted: a receive posted after the send
waits for the *sender's* transport thread to answer it, which on a core busy with the
sender's next forward takes milliseconds (measured here: median 7 ms, against 1 ms for a receive
posted first). So requests and replies travel as one fixed-size frame (the length and the
first bytes; the rare rest follows in a second message of known size), and each later rank
posts the receive of the next request's frame as soon as it has taken one; a stage posts the
receive of a step's hidden states before it prepares that step's inputs, and stage 0 the
receive of the sampled ids right after its forward.
"""

from __future__ import annotations

import datetime
import socket
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from vserve.distributed.grid import GridRank
from vserve.distributed.tp_comm import build_tp_comm
from vserve.envs import ENV

FRAME_BYTES = 16 * 1024  # a request or reply frame: int64 length, then its first bytes
_GOODBYE = -1  # the length of the frame `close` sends: no request follows


class PPComm:
    def __init__(
        self,
        grid: GridRank,
        master_addr: str,
        master_port: int,
        device: torch.device,
        hidden_size: int,
        dtype: torch.dtype,
        tp_shm: bool = True,
    ) -> None:
        """`tp_shm`: the TP group lives on one host (CPU: all-reduce in shared memory)."""
        self.grid = grid
        self.rank, self.world_size = grid.rank, grid.world_size
        self.stage, self.last_stage = grid.pp_rank, grid.pp_size - 1
        self.device, self.hidden_size, self.dtype = device, hidden_size, dtype
        timeout = datetime.timedelta(seconds=ENV.dist_timeout)
        self._listener, store = _make_store(
            self.rank, self.world_size, master_addr, master_port, timeout
        )
        dist.init_process_group(
            "gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        self.chain = dist.new_group(backend="gloo")
        self.ctrl = dist.new_group(backend="gloo")
        self.reply = dist.new_group(backend="gloo")
        self.data = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
        self.spans = dist.new_group(backend="gloo")
        self.tp = build_tp_comm(grid, device, tp_shm, ENV.dist_timeout)
        self.source = grid.request_source
        self._next_request: tuple[object, torch.Tensor] | None = None  # posted frame receive
        # sends not yet waited for (gloo completes a send only in `wait`), with their tensors;
        # the engine keeps at most pp + 1 steps in flight, so the oldest beyond this many was
        # taken long ago and waiting for it costs nothing
        self._inflight: deque[tuple[object, torch.Tensor]] = deque()
        self._max_inflight = 4 * (grid.pp_size + 2)

    # -- control plane -----------------------------------------------------------------------------
    def pass_request(self, data: bytes | None) -> bytes:
        """Rank 0 passes the engine core's request; each other rank receives it from its
        source rank (and posts the receive of the next one at once). Every rank sends it on
        to its targets without waiting."""
        if self.source is not None:
            data = self._take_request(self.source)
        assert data is not None
        for dst in self.grid.request_targets:
            self._send_framed(data, dst, self.chain)
        return data

    def _take_request(self, src: int) -> bytes:
        if self._next_request is None:
            self._next_request = _post_frame(src, self.chain)
        work, frame = self._next_request
        work.wait()
        data = _read_frame(frame, src, self.chain)
        self._next_request = _post_frame(src, self.chain)
        return data

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
        return int(t.item())

    def send_reply(self, data: bytes) -> None:
        for work, _ in _frames(data, 0, self.reply):
            work.wait()

    def recv_reply(self) -> bytes:
        sampler = self.grid.sampler_rank
        work, frame = _post_frame(sampler, self.reply)
        work.wait()
        return _read_frame(frame, sampler, self.reply)

    def _send_framed(self, data: bytes, dst: int, group) -> None:
        for work, tensor in _frames(data, dst, group):
            self._track(work, tensor)

    # -- data plane --------------------------------------------------------------------------------
    def post_recv_hidden(self, so) -> Callable[[], tuple[torch.Tensor, list[tuple[float, float]]]]:
        """Post the receive of the previous stage's hidden states [T, hidden] and the forward
        spans of every stage before this one (first to last); the returned call waits for
        them. On CPU both come in one message (each message costs the sender a gloo send,
        about as long as the copy of a batch's hidden states)."""
        shape = (so.total_num_scheduled_tokens, self.hidden_size)
        src = self.grid.peer(self.stage - 1)
        if self.device.type != "cpu":
            spans = torch.empty(self.stage, 2, dtype=torch.float64)
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            works = [dist.irecv(spans, src=src, group=self.spans)]
            works.append(dist.irecv(buf, src=src, group=self.data))

            def wait_device():
                for work in works:
                    work.wait()
                return buf, [(start, end) for start, end in spans.tolist()]

            return wait_device
        num_bytes = shape[0] * shape[1] * self.dtype.itemsize
        packed = torch.empty(num_bytes + 16 * self.stage, dtype=torch.uint8)
        work = dist.irecv(packed, src=src, group=self.data)

        def wait_cpu():
            work.wait()
            times = packed[num_bytes:].clone().view(torch.float64).view(self.stage, 2)
            hidden = packed[:num_bytes].view(self.dtype).view(shape)
            return hidden, [(start, end) for start, end in times.tolist()]

        return wait_cpu

    def send_hidden(self, so, hidden: torch.Tensor, spans: list[tuple[float, float]]) -> None:
        """`spans`: the forward (start, end) of this stage and of every one before it."""
        spans_t = torch.tensor(spans, dtype=torch.float64).reshape(self.stage + 1, 2)
        dst = self.grid.peer(self.stage + 1)
        if self.device.type != "cpu":  # (the spans stay off the device: no copy to wait for)
            self._isend(spans_t, dst, self.spans)
            self._isend(hidden.contiguous(), dst, self.data)
            return
        packed = torch.cat(
            [hidden.contiguous().view(-1).view(torch.uint8), spans_t.view(-1).view(torch.uint8)]
        )
        self._isend(packed, dst, self.data)

    def send_sampled(self, so, token_ids: torch.Tensor) -> None:
        """The sampler's ids to every first-stage rank that builds inputs from them."""
        ids = token_ids.contiguous()
        for dst in self.grid.feedback_ranks:
            self._isend(ids, dst, self.data)

    def recv_sampled(self, so, num: int):
        buf = torch.empty(num, dtype=torch.int64, device=self.device)
        work = dist.irecv(buf, src=self.grid.sampler_rank, group=self.data)
        return buf, work.wait

    def _isend(self, tensor: torch.Tensor, dst: int, group) -> None:
        self._track(dist.isend(tensor, dst=dst, group=group), tensor)

    def _track(self, work, tensor: torch.Tensor) -> None:
        # keep the tensor alive until the send completed
        self._inflight.append((work, tensor))
        while len(self._inflight) > self._max_inflight:
            self._inflight.popleft()[0].wait()

    def close(self) -> None:
        """After the shutdown request: each target's posted frame receive gets a goodbye
        frame, and this rank waits for the one its source sends it."""
        for dst in self.grid.request_targets:
            self._track(*_goodbye_frame(dst, self.chain))
        if self._next_request is not None:
            try:
                self._next_request[0].wait(datetime.timedelta(seconds=10))
            except RuntimeError:  # the previous rank is gone: nothing more will come
                pass
            self._next_request = None
        for work, _ in self._inflight:
            try:
                work.wait()
            except RuntimeError:
                pass
        self.tp.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _frames(data: bytes, dst: int, group) -> list[tuple[object, torch.Tensor]]:
    """Send `data` as a frame (length, first bytes) and, if it does not fit, the rest."""
    first = min(len(data), FRAME_BYTES - 8)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    frame = _frame(len(data), payload[:first] if payload is not None else None)
    sends = [(dist.isend(frame, dst=dst, group=group), frame)]
    if payload is not None and len(data) > first:
        rest = payload[first:]
        sends.append((dist.isend(rest, dst=dst, group=group), rest))
    return sends


def _goodbye_frame(dst: int, group) -> tuple[object, torch.Tensor]:
    frame = _frame(_GOODBYE, None)
    return dist.isend(frame, dst=dst, group=group), frame


def _frame(length: int, head: torch.Tensor | None) -> torch.Tensor:
    """A frame: `length` as int64, then `head` (the message's first bytes), zero-padded."""
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[:8] = torch.tensor([length], dtype=torch.int64).view(torch.uint8)
    if head is not None:
        frame[8 : 8 + len(head)] = head
    return frame


def _post_frame(src: int, group) -> tuple[object, torch.Tensor]:
    frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
    return dist.irecv(frame, src=src, group=group), frame


def _read_frame(frame: torch.Tensor, src: int, group) -> bytes:
    """The message of a received frame (and of the rest, received now, if it had one)."""
    length = int(frame[:8].view(torch.int64).item())
    if length < 0:
        raise EOFError("the previous pipeline rank closed")
    first = min(length, FRAME_BYTES - 8)
    data = frame[8 : 8 + first].numpy().tobytes()
    if length > first:
        rest = torch.empty(length - first, dtype=torch.uint8)
        dist.recv(rest, src=src, group=group)
        data += rest.numpy().tobytes()
    return data


def _make_store(rank: int, world_size: int, addr: str, port: int, timeout):
    """The rendezvous store, its server (rank 0) listening on `addr` only. c10d's TCPStore
    listens on every interface whatever host it is given, so rank 0 binds the socket itself
    and hands it over; the socket must stay open while the store lives."""
    if rank != 0:
        return None, dist.TCPStore(addr, port, world_size, False, timeout)
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((addr, port), family=family)
    store = dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=listener.fileno())
    return listener, store
