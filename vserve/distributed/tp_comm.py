"""The collectives a tensor-parallel model calls: all-reduce after a row-parallel layer (and
the vocab-parallel embedding), all-gather of the vocab-parallel logits.

One `TPComm` per rank, over its stage's TP group. On CPU the ranks of one host all-reduce
through shared memory (`ShmAllReduce`); a group spanning hosts uses gloo. On CUDA the group
is NCCL. Models receive a `TPShard` (rank, size and this comm) and never import
torch.distributed themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vserve.distributed.shm_allreduce import ShmAllReduce


class TPComm:
    def __init__(self, group, rank: int, size: int, shm: ShmAllReduce | None = None) -> None:
        self.group, self.rank, self.size, self.shm = group, rank, size, shm

    @property
    def kind(self) -> str:
        return "shm" if self.shm is not None else dist.get_backend(self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks, the same bits on every rank."""
        if self.shm is not None and x.device.type == "cpu":
            return self.shm.all_reduce(x)
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()


@dataclass(frozen=True)
class TPShard:
    """This rank's place in its TP group, what the model's layers shard by."""

    rank: int = 0
    size: int = 1
    comm: TPComm | None = None  # None only when size == 1

    def key(self) -> str:
        """What identifies this shard's weights (weight cache file names)."""
        return "" if self.size == 1 else f"tp{self.rank}of{self.size}"


def build_tp_comm(grid, device: torch.device, shm: bool, timeout_s: float) -> TPComm:
    """Create every stage's TP group (each rank of the world must call this, in step) and
    return this rank's comm. `shm`: its group lives on one host and may use shared memory
    (CPU only)."""
    if grid.tp_size == 1:
        return TPComm(None, 0, 1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    mine = None
    for stage in range(grid.pp_size):
        ranks = grid.tp_group_ranks(stage)
        group = dist.new_group(ranks, backend=backend)
        if stage == grid.pp_rank:
            mine = group
    segment = None
    if shm and device.type == "cpu" and grid.tp_size > 1:
        segment = ShmAllReduce(mine, grid.tp_rank, grid.tp_size, timeout_s=timeout_s)
    return TPComm(mine, grid.tp_rank, grid.tp_size, segment)
