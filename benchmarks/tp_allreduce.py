"""The tensor-parallel all-reduce alone: shared memory (`ShmAllReduce`) against gloo, between
ranks of one host, at the embedded model's hidden size (640).

Each rank is a spawned process (pinned to its own core when there are enough). Every case
runs both collectives alternately, `--repeats` rounds of `--iters` calls each, so load from
other processes hits both alike; reported is the median time per call (rank 0's clock; the
collective ends on every rank together) and the ratio gloo / shm. A decoder layer calls two
all-reduces (after attention and after the MLP), the embedding one more.

    python benchmarks/tp_allreduce.py [--ranks 2] [--hidden 640] [--tokens 1,8,32,256]

Prints a markdown table and writes benchmarks/results/tp_allreduce.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _rank(rank: int, args, port: int, results) -> None:
    import torch.distributed as dist

    from vserve.distributed.shm_allreduce import ShmAllReduce

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= args.ranks:
        os.sched_setaffinity(0, {cpus[rank]})
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, args.ranks, rank == 0, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks)
    shm = ShmAllReduce(None, rank, args.ranks)
    rows = []
    for dtype_name in args.dtypes.split(","):
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(tokens, args.hidden).to(DTYPES[dtype_name])
            times: dict[str, list[float]] = {"shm": [], "gloo": []}
            for _ in range(args.repeats):
                for name in ("shm", "gloo"):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(args.iters):
                        if name == "shm":
                            shm.all_reduce(x)
                        else:
                            y = x.clone()
                            dist.all_reduce(y)
                    times[name].append((time.perf_counter() - start) / args.iters)
            shm_us = statistics.median(times["shm"]) * 1e6
            gloo_us = statistics.median(times["gloo"]) * 1e6
            rows.append(
                {
                    "dtype": dtype_name,
                    "tokens": tokens,
                    "bytes": x.numel() * x.element_size(),
                    "shm_us": round(shm_us, 1),
                    "gloo_us": round(gloo_us, 1),
                    "gloo_over_shm": round(gloo_us / shm_us, 2),
                }
            )
    shm.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--tokens", default="1,8,32,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/tp_allreduce.json"))
    args = parser.parse_args()
    from vserve.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args, port, results), daemon=True)
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    rows = results.get(timeout=600)
    for p in procs:
        p.join(timeout=30)
    print(f"all-reduce between {args.ranks} ranks, hidden {args.hidden}: median us per call")
    print("| dtype | tokens | bytes | shm (us) | gloo (us) | gloo / shm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['tokens']} | {r['bytes']} | {r['shm_us']} | "
            f"{r['gloo_us']} | {r['gloo_over_shm']} |"
        )
    meta = {"ranks": args.ranks, "hidden": args.hidden, "cpus": os.cpu_count(), "rows": rows}
    Path(args.out).write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
