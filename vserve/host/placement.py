"""Where work runs on a CPU host: which cores the workers' threads use, and whether a core is
reserved for the host work (engine core and front end) that runs beside each forward.

Pure functions of the CPU list, the number of local workers, the user's overrides and
measured per-step figures; `vserve.host.placement_control` applies them. Why reserve:
torch's OpenMP team stalls whenever the engine core or the front end takes one of its cores
in the middle of a parallel region, so host work that is large next to the forward makes
every forward slower; on its own core it runs beside the forward instead. Reserving costs
the workers one core, so it pays only when the host work per step is a real share of it.

| reserved | workers' CPUs                         | threads per worker | host CPUs         |
|----------|---------------------------------------|--------------------|-------------------|
| 0        | unpinned                              | cpus // workers    | unpinned          |
| r >= 1   | the other CPUs, one contiguous group  | size of its group  | the first r CPUs  |
|          | per worker                            |                    |                   |
| bind     | the groups the user named             | size of its group  | CPUs no worker    |
|          |                                       |                    | has (or unpinned) |
| 0, TP    | one contiguous group per worker       | size of its group  | unpinned          |

Tensor-parallel ranks of a stage compute at the same time and meet at every all-reduce, so
each keeps its own cores (`pin_workers`) even when no core is reserved: an OpenMP team that
shares a core with another rank's stalls the whole group (unless there are fewer cores than
workers: then they stay unpinned, one thread each).

Prefill threads: unpinned workers of PP stages share the host's cores, and in a prompt-heavy
step (a prefill chunk) a stage's work is its share of the local stages' layers, where the
lm_head that evens out decode steps costs almost nothing. Such a step runs on
round(cores x that share) threads (at least the decode count): on 2 cores with the embedded
model split 16 + 2 for decode, stage 0 prefills on both cores while stage 1 mostly waits for
it. Pinned workers keep their group's cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Host work beside the forward, as CPU time per CPU second the workers use: from this share a
# core is reserved, below the second it is given back. CPU time, not wall time, so that other
# load on the machine scales both sides alike; the gap keeps a placement from flapping.
RESERVE_ABOVE = 0.2
RELEASE_BELOW = 0.1


@dataclass(frozen=True)
class Placement:
    worker_cpus: tuple[tuple[int, ...], ...]  # per local worker; () = unpinned
    worker_threads: tuple[int, ...]  # torch intra-op threads per local worker
    host_cpus: tuple[int, ...]  # engine core and front end; () = unpinned
    num_reserved: int
    prefill_threads: tuple[int, ...] = ()  # per local worker, in prompt-heavy steps

    def prefill_threads_of(self, i: int) -> int:
        return self.prefill_threads[i] if self.prefill_threads else self.worker_threads[i]

    @property
    def pins_host(self) -> bool:
        return bool(self.host_cpus)


@dataclass(frozen=True)
class PlacementOverrides:
    """From VSERVE_CPU_NUM_RESERVED and VSERVE_CPU_THREADS_BIND (None: choose automatically)."""

    num_reserved: int | None = None
    bind: tuple[tuple[int, ...], ...] | None = None  # one CPU group per local worker
    nobind: bool = False  # leave every thread where the OS puts it

    @property
    def fixed(self) -> bool:
        return self.nobind or self.bind is not None or self.num_reserved is not None


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """ "0-3,6" -> (0, 1, 2, 3, 6)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if last < first or first < 0:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return tuple(dict.fromkeys(cpus))


def parse_overrides(num_reserved: str | None, bind: str | None) -> PlacementOverrides:
    """The two environment values as given (None or "auto": automatic)."""
    reserved = None
    if num_reserved not in (None, "", "auto"):
        reserved = int(num_reserved)
        if reserved < 0:
            raise ValueError(f"VSERVE_CPU_NUM_RESERVED must be >= 0, got {num_reserved}")
    if bind in (None, "", "auto"):
        return PlacementOverrides(reserved)
    if bind == "nobind":
        return PlacementOverrides(reserved, nobind=True)
    return PlacementOverrides(reserved, tuple(parse_cpu_list(g) for g in bind.split("|")))


def plan_placement(
    cpus: Sequence[int],
    num_workers: int,
    num_reserved: int,
    overrides: PlacementOverrides = PlacementOverrides(),
    layer_shares: Sequence[float] = (),
    pin_workers: bool = False,
) -> Placement:
    """The placement for `num_reserved` host cores (capped so every worker keeps a core).
    `layer_shares`: each local worker's share of the local stages' decoder layers (PP).
    `pin_workers` (TP): every worker on its own cores even with none reserved."""
    cpus = tuple(sorted(cpus))
    if overrides.nobind:
        return _unpinned(cpus, num_workers, layer_shares)
    if overrides.bind is not None:
        return _bound(cpus, num_workers, overrides.bind)
    reserved = max(0, min(num_reserved, len(cpus) - num_workers))
    if reserved == 0 and pin_workers and len(cpus) >= num_workers:
        groups = _split(cpus, num_workers)
        return Placement(groups, tuple(len(g) for g in groups), (), 0)
    if reserved == 0:
        return _unpinned(cpus, num_workers, layer_shares)
    host, rest = cpus[:reserved], cpus[reserved:]
    groups = _split(rest, num_workers)
    return Placement(groups, tuple(len(g) for g in groups), host, reserved)


def choose_num_reserved(
    host_cpu_s: float,
    worker_cpu_s: float,
    current: int,
    num_cpus: int,
    num_workers: int,
    overrides: PlacementOverrides = PlacementOverrides(),
) -> int:
    """How many cores to reserve, from one window of measurements.

    host_cpu_s: CPU seconds the host spent beside the forward (engine core and front end
    under async scheduling; the front end alone when the engine core waits for each step).
    worker_cpu_s: CPU seconds the workers used in the same window (all their threads)."""
    if overrides.num_reserved is not None:
        return overrides.num_reserved
    if overrides.nobind or overrides.bind is not None or num_cpus < num_workers + 1:
        return 0
    if worker_cpu_s <= 0:
        return current
    share = host_cpu_s / worker_cpu_s
    if current:
        return current if share >= RELEASE_BELOW else 0
    return 1 if share >= RESERVE_ABOVE else 0


def _unpinned(cpus: tuple[int, ...], num_workers: int, layer_shares: Sequence[float]) -> Placement:
    threads = max(1, len(cpus) // max(1, num_workers))
    prefill = tuple(
        max(threads, min(len(cpus), round(len(cpus) * share))) for share in layer_shares
    )
    return Placement(((),) * num_workers, (threads,) * num_workers, (), 0, prefill)


def layer_shares(layer_counts: Sequence[int], local_ranks: Sequence[int]) -> tuple[float, ...]:
    """Each local rank's share of the decoder layers the local ranks hold (() for one rank:
    nothing to share)."""
    if len(local_ranks) < 2:
        return ()
    local = [layer_counts[r] if r < len(layer_counts) else 0 for r in local_ranks]
    total = sum(local)
    return tuple(n / total if total else 1 / len(local) for n in local)


def _bound(cpus: tuple[int, ...], num_workers: int, bind: tuple[tuple[int, ...], ...]) -> Placement:
    if len(bind) != num_workers:
        raise ValueError(
            f"VSERVE_CPU_THREADS_BIND names {len(bind)} CPU groups for "
            f"{num_workers} local workers ('|' separates the groups)"
        )
    unknown = sorted({c for g in bind for c in g} - set(cpus))
    if unknown:
        raise ValueError(
            f"VSERVE_CPU_THREADS_BIND names CPUs {unknown} outside this process's CPUs {list(cpus)}"
        )
    used = {c for g in bind for c in g}
    host = tuple(c for c in cpus if c not in used)
    return Placement(tuple(bind), tuple(len(g) for g in bind), host, len(host))


def _split(cpus: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous, as even as possible (the first groups get the remainder)."""
    size, extra = divmod(len(cpus), parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        groups.append(cpus[start:end])
        start = end
    return tuple(groups)
