"""Where a worker rank sits in the TP x PP grid: pure arithmetic, no torch.

Global rank = pp_rank * tp_size + tp_rank: the ranks of one pipeline stage are contiguous, so
they share a host whenever the hosts split the grid by stages (`local_ranks`). Rank 0 of the
grid alone talks to the engine core; the sampling rank is TP rank 0 of the last stage.

| who                | receives requests from       | sends requests to                       |
|--------------------|------------------------------|-----------------------------------------|
| rank 0             | the engine core (a pipe)     | its TP peers, then stage 1's TP rank 0  |
| stage 0, tp t > 0  | rank 0                       | stage 1, tp t                           |
| stage s > 0, tp t  | stage s - 1, tp t            | stage s + 1, tp t (if any)              |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GridRank:
    rank: int
    pp_size: int = 1
    tp_size: int = 1

    @staticmethod
    def of(pp_rank: int, tp_rank: int, pp_size: int, tp_size: int) -> GridRank:
        return GridRank(pp_rank * tp_size + tp_rank, pp_size, tp_size)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_sampler(self) -> bool:
        """TP rank 0 of the last stage: samples, and replies to the engine through rank 0."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def sampler_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    def peer(self, pp_rank: int) -> int:
        """The global rank of stage `pp_rank` in this rank's TP column."""
        return pp_rank * self.tp_size + self.tp_rank

    def tp_group_ranks(self, pp_rank: int | None = None) -> list[int]:
        stage = self.pp_rank if pp_rank is None else pp_rank
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    @property
    def request_source(self) -> int | None:
        """The rank this one takes requests from (None: the engine core)."""
        if self.pp_rank > 0:
            return self.peer(self.pp_rank - 1)
        return 0 if self.tp_rank else None

    @property
    def request_targets(self) -> list[int]:
        """The ranks this one passes each request on to (TP peers first: they start at once)."""
        targets = self.tp_group_ranks(0)[1:] if self.rank == 0 else []
        if not self.is_last_stage:
            targets.append(self.peer(self.pp_rank + 1))
        return targets

    @property
    def feedback_ranks(self) -> list[int]:
        """The first stage's ranks that take the sampled ids from the sampler (not itself)."""
        return [r for r in self.tp_group_ranks(0) if r != self.sampler_rank]


def local_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The grid ranks of host `node_rank`: an equal, contiguous share of the grid."""
    if world_size % nnodes:
        raise ValueError(
            f"the grid's {world_size} ranks (pipeline x tensor parallel) must be a multiple "
            f"of nnodes {nnodes}"
        )
    per_node = world_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def node_of(rank: int, world_size: int, nnodes: int) -> int:
    return rank // (world_size // nnodes)


def tp_group_on_one_host(grid: GridRank, nnodes: int) -> bool:
    """Whether every rank of this rank's TP group lives on its host (the shared-memory
    all-reduce needs that; a group across hosts all-reduces over gloo)."""
    nodes = {node_of(r, grid.world_size, nnodes) for r in grid.tp_group_ranks()}
    return len(nodes) == 1
