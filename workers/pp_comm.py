"""Pipeline-parallel communication over torch.distributed.

Four process groups, so that traffic of different kinds never interleaves:

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
  the last stage back to stage 0 for the on-device token feedback.
"""

from __future__ import annotations

import datetime
import socket
from collections import deque

import torch
import torch.distributed as dist

from vserve.envs import ENV


class PPComm:
    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        device: torch.device,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.hidden_size, self.dtype = device, hidden_size, dtype
        timeout = datetime.timedelta(seconds=ENV.dist_timeout)
        self._listener, store = _make_store(rank, world_size, master_addr, master_port, timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        self.chain = dist.new_group(backend="gloo")
        self.ctrl = dist.new_group(backend="gloo")
        self.reply = dist.new_group(backend="gloo")
        self.data = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
        self.last = world_size - 1
        # sends not yet waited for (gloo completes a send only in `wait`), with their tensors;
        # the engine keeps at most pp + 1 steps in flight, so the oldest beyond this many was
        # taken long ago and waiting for it costs nothing
        self._inflight: deque[tuple[object, torch.Tensor]] = deque()
        self._max_inflight = 4 * (world_size + 2)

    # -- control plane -----------------------------------------------------------------------------
    def pass_request(self, data: bytes | None) -> bytes:
        """Rank 0 passes the engine core's request; each other rank receives it from the
        previous rank. Every rank but the last sends it on to the next without waiting."""
        if self.rank > 0:
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, src=self.rank - 1, group=self.chain)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buf, src=self.rank - 1, group=self.chain)
            data = buf.numpy().tobytes()
        if self.rank < self.last:
            self._isend(torch.tensor([len(data)], dtype=torch.int64), self.rank + 1, self.chain)
            self._isend(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), self.rank + 1, self.chain
            )
        return data

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
        return int(t.item())

    def send_reply(self, data: bytes) -> None:
        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=0, group=self.reply)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=self.reply)

    def recv_reply(self) -> bytes:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self.last, group=self.reply)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buf, src=self.last, group=self.reply)
        return buf.numpy().tobytes()

    # -- data plane --------------------------------------------------------------------------------
    def recv_hidden(self, so, inputs) -> tuple[torch.Tensor, list[tuple[float, float]]]:
        """The previous stage's hidden states [T, hidden] and the forward spans of every
        stage before this one, first to last. On CPU both come in one message (each message
        costs the sender a gloo send, about as long as the copy of a batch's hidden states)."""
        shape = (so.total_num_scheduled_tokens, self.hidden_size)
        if self.device.type != "cpu":
            spans = torch.empty(self.rank, 2, dtype=torch.float64)
            dist.recv(spans, src=self.rank - 1, group=self.chain)
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(buf, src=self.rank - 1, group=self.data)
            return buf, [(start, end) for start, end in spans.tolist()]
        num_bytes = shape[0] * shape[1] * self.dtype.itemsize
        buf = torch.empty(num_bytes + 16 * self.rank, dtype=torch.uint8)
        dist.recv(buf, src=self.rank - 1, group=self.data)
        spans = buf[num_bytes:].clone().view(torch.float64).view(self.rank, 2)
        return buf[:num_bytes].view(self.dtype).view(shape), [
            (start, end) for start, end in spans.tolist()
        ]

    def send_hidden(self, so, hidden: torch.Tensor, spans: list[tuple[float, float]]) -> None:
        """`spans`: the forward (start, end) of this stage and of every one before it."""
        spans_t = torch.tensor(spans, dtype=torch.float64).reshape(self.rank + 1, 2)
        if self.device.type != "cpu":  # (the spans stay off the device: no copy to wait for)
            self._isend(spans_t, self.rank + 1, self.chain)
            self._isend(hidden.contiguous(), self.rank + 1, self.data)
            return
        packed = torch.cat(
            [hidden.contiguous().view(-1).view(torch.uint8), spans_t.view(-1).view(torch.uint8)]
        )
        self._isend(packed, self.rank + 1, self.data)

    def send_sampled(self, so, token_ids: torch.Tensor) -> None:
        self._isend(token_ids.contiguous(), 0, self.data)

    def recv_sampled(self, so, num: int):
        buf = torch.empty(num, dtype=torch.int64, device=self.device)
        work = dist.irecv(buf, src=self.last, group=self.data)
        return buf, work.wait

    def _isend(self, tensor: torch.Tensor, dst: int, group) -> None:
        # keep the tensor alive until the send completed
        self._inflight.append((dist.isend(tensor, dst=dst, group=group), tensor))
        while len(self._inflight) > self._max_inflight:
            self._inflight.popleft()[0].wait()

    def close(self) -> None:
        for work, _ in self._inflight:
            try:
                work.wait()
            except RuntimeError:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


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
