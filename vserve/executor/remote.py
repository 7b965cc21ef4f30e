"""`vserve worker`: the grid ranks (pipeline stages, TP shards) of one non-zero host of a
multi-host engine.

Every host runs the same model arguments; host `node_rank` owns grid ranks
`[node_rank * world / nnodes, (node_rank + 1) * world / nnodes)` (world = pp x tp; ranks of a
stage are contiguous, so a host holds whole stages when nnodes divides pp). The ranks meet
the engine's host through torch.distributed's TCP rendezvous at `--master-addr:--master-port`;
all requests and replies travel over torch.distributed through rank 0, so no other socket
crosses hosts.

Ctrl-C or SIGTERM stops the ranks (SIGTERM, then SIGKILL after `STOP_GRACE_S`) and returns at
once; the ranks also exit by themselves if this process dies.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from contextlib import contextmanager
from multiprocessing.connection import wait

from vserve.config import EngineConfig
from vserve.distributed.grid import local_ranks
from vserve.host.affinity import available_cpus
from vserve.host.placement import layer_shares, plan_placement
from vserve.workers.runner_config import RunnerConfig
from vserve.workers.worker_proc import RankSetup, worker_main

logger = logging.getLogger("vserve.worker")
STOP_GRACE_S = 3.0


def run_remote_workers(config: EngineConfig) -> int:
    par = config.parallel
    if par.node_rank == 0 or par.nnodes < 2:
        raise ValueError(
            "`vserve worker` runs the stages of a host with --node-rank >= 1 of --nnodes >= 2"
        )
    if not par.master_port:
        raise ValueError("--master-port is required for multi-host pipeline parallel")
    ranks = local_ranks(par.world_size, par.nnodes, par.node_rank)
    received: list[int] = []
    with _stop_signals(received):  # from before the first rank starts to the return
        procs = _start_ranks(config, ranks)
        logger.warning(
            "node %d: started ranks %s, waiting for the engine at %s:%d",
            par.node_rank,
            list(ranks),
            par.master_addr,
            par.master_port,
        )
        return _supervise(procs, received)


def _start_ranks(config: EngineConfig, ranks: range) -> list:
    par = config.parallel
    tp = par.tensor_parallel_size
    placement = plan_placement(
        available_cpus(),
        len(ranks),
        0,
        layer_shares=layer_shares(par.layer_partition, [r // tp for r in ranks]),
        pin_workers=tp > 1,
    )
    ctx = mp.get_context("spawn")
    procs = []
    for i, rank in enumerate(ranks):
        setup = RankSetup(
            rank,
            par.world_size,
            par.master_addr,
            par.master_port,
            placement.worker_threads[i],
            placement.worker_cpus[i],
            placement.prefill_threads_of(i),
        )
        proc = ctx.Process(
            target=worker_main,
            args=(RunnerConfig.of(config, rank // tp, rank % tp), setup),
            name=f"vserve-worker-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


@contextmanager
def _stop_signals(received: list[int]):
    """SIGINT and SIGTERM are noted in `received` (not fatal) while the block runs."""
    previous = {
        s: signal.signal(s, lambda signum, _: received.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(procs: list, received: list[int]) -> int:
    """Wait for the ranks; on SIGINT / SIGTERM stop them. Exit status: the first non-zero
    exit code of a rank, or 128 + signal number when stopped by a signal."""
    while not received and any(p.is_alive() for p in procs):
        wait([p.sentinel for p in procs if p.is_alive()], timeout=0.2)
    if received:
        logger.warning("stopping the ranks (signal %d)", received[0])
        _stop(procs)
        return 128 + received[0]
    return next((p.exitcode for p in procs if p.exitcode), 0)


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
