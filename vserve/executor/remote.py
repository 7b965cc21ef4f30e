"""`vserve worker`: the pipeline stages of one non-zero host of a multi-host engine.

Every host runs the same model arguments; host `node_rank` owns ranks
`[node_rank * pp / nnodes, (node_rank + 1) * pp / nnodes)`. The ranks meet the engine's host
through torch.distributed's TCP rendezvous at `--master-addr:--master-port`; all requests and
replies travel over torch.distributed through rank 0, so no other socket crosses hosts.
"""

from __future__ import annotations

import logging
import multiprocessing as mp

from vserve.config import EngineArgs
from vserve.executor.base import runner_config
from vserve.executor.multiproc import _threads_per_worker, local_ranks
from workers.worker_proc import RankSetup, worker_main

logger = logging.getLogger("vserve.worker")


def run_remote_workers(args: EngineArgs) -> int:
    config = args.create_engine_config()
    par = config.parallel
    if par.node_rank == 0 or par.nnodes < 2:
        raise ValueError("`vserve worker` runs the stages of a host with --node-rank >= 1 "
                         "of --nnodes >= 2")
    if not par.master_port:
        raise ValueError("--master-port is required for multi-host pipeline parallel")
    ranks = local_ranks(par.pipeline_parallel_size, par.nnodes, par.node_rank)
    threads = _threads_per_worker(len(ranks))
    ctx = mp.get_context("spawn")
    procs = []
    for rank in ranks:
        setup = RankSetup(rank, par.pipeline_parallel_size, par.master_addr, par.master_port,
                          threads)
        proc = ctx.Process(target=worker_main, args=(runner_config(config, rank), setup),
                           name=f"vserve-worker-{rank}")
        proc.start()
        procs.append(proc)
    logger.warning("node %d: started ranks %s, waiting for the engine at %s:%d", par.node_rank,
                   list(ranks), par.master_addr, par.master_port)
    code = 0
    for proc in procs:
        proc.join()
        code = code or (proc.exitcode or 0)
    return code
