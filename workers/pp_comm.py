"""Pipeline-parallel communication over torch.distributed.

Three process groups, so that traffic of different kinds never interleaves:

* control (gloo): rank 0 broadcasts each request it receives from the engine core;
* reply (gloo): the last stage sends each step's result back to rank 0, which forwards it
  to the engine core (so only rank 0 talks to the engine, even across hosts);
* data (gloo on CPU, nccl on CUDA): hidden states stage to stage, and the sampled ids from
  the last stage back to stage 0 for the on-device token feedback.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from vserve.envs import ENV


class PPComm:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 device: torch.device, hidden_size: int, dtype: torch.dtype) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.hidden_size, self.dtype = device, hidden_size, dtype
        timeout = datetime.timedelta(seconds=ENV.dist_timeout)
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, timeout=timeout)
        self.ctrl = dist.new_group(backend="gloo")
        self.reply = dist.new_group(backend="gloo")
        self.data = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
        self.last = world_size - 1
        self._inflight: list[tuple[object, torch.Tensor]] = []

    # -- control plane -----------------------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 passes the payload, the others get it."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.ctrl)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
               else torch.empty(int(size.item()), dtype=torch.uint8))
        dist.broadcast(buf, src=0, group=self.ctrl)
        return data if self.rank == 0 else buf.numpy().tobytes()

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
    def recv_hidden(self, so, inputs) -> torch.Tensor:
        buf = torch.empty(so.total_num_scheduled_tokens, self.hidden_size, dtype=self.dtype,
                          device=self.device)
        dist.recv(buf, src=self.rank - 1, group=self.data)
        return buf

    def send_hidden(self, so, hidden: torch.Tensor) -> None:
        self._isend(hidden.contiguous(), self.rank + 1)

    def send_sampled(self, so, token_ids: torch.Tensor) -> None:
        self._isend(token_ids.contiguous(), 0)

    def recv_sampled(self, so, num: int):
        buf = torch.empty(num, dtype=torch.int64, device=self.device)
        work = dist.irecv(buf, src=self.last, group=self.data)
        return buf, work.wait

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        # keep the tensor alive until the send completed
        self._inflight = [(w, t) for w, t in self._inflight if not w.is_completed()]
        self._inflight.append((dist.isend(tensor, dst=dst, group=self.data), tensor))

    def close(self) -> None:
        for work, _ in self._inflight:
            try:
                work.wait()
            except RuntimeError:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
