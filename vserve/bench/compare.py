"""`--compare-sync` of `vserve bench throughput | latency`: the same workload run twice in one
process, async scheduling off and then on, every other engine argument the same. That
includes the executor: one left unset becomes async's default (worker processes on a CPU) in
both runs, so the two forwards run in the same process layout and the sync run's step
records can calibrate the async run's overlap report (see `vserve.bench.overlap`). Async
against the *best* sync configuration (in-process or worker processes) is
`benchmarks/modes.py --workload host-bound --rows sync-uni sync-mp async`. The result
gains the ratio of the two runs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from vserve.engine.arg_utils import EngineArgs


def add_compare_arg(p) -> None:
    p.add_argument(
        "--compare-sync",
        action="store_true",
        help="run the workload with async scheduling off, then on (same engine "
        "args and executor otherwise), in this process; print both and "
        "async's speedup",
    )


def mode_engine_args(engine_args: EngineArgs) -> tuple[EngineArgs, EngineArgs]:
    """(sync, async) engine args for --compare-sync."""
    if engine_args.async_scheduling is False:
        raise ValueError("--compare-sync runs both modes; drop --no-async-scheduling")
    async_args = dataclasses.replace(engine_args, async_scheduling=True)
    if async_args.distributed_executor_backend is None:
        backend = async_args.create_engine_config().parallel.distributed_executor_backend
        async_args = dataclasses.replace(async_args, distributed_executor_backend=backend)
    return dataclasses.replace(async_args, async_scheduling=False), async_args


def run_both(run_one: Callable, engine_args: EngineArgs):
    """`run_one(engine_args, calibration) -> (result, records, ...)`: sync first, its records
    calibrate the async run. Returns both runs' tuples."""
    sync_args, async_args = mode_engine_args(engine_args)
    sync = run_one(sync_args, None)
    return sync, run_one(async_args, sync[1])


def run_maybe_compared(
    args, engine_args: EngineArgs, run_one: Callable, key: str, higher_is_better: bool, unit: str
):
    """`run_one(args, engine_args, calibration=None) -> (result, records, spans)` once, or
    sync then async with `--compare-sync` (the async run's tuple, its result gaining
    `compare_sync` on `key`)."""
    if not args.compare_sync:
        return run_one(args, engine_args)
    sync, (result, records, spans) = run_both(
        lambda ea, calibration: run_one(args, ea, calibration), engine_args
    )
    result["compare_sync"] = comparison(sync[0], result, key, higher_is_better)
    result["compare_sync"]["sync_result"] = sync[0]
    print_comparison(result["compare_sync"], unit)
    return result, records, spans


def comparison(sync: dict, async_: dict, key: str, higher_is_better: bool) -> dict:
    """Async's speedup over sync on one figure of the two results."""
    a, s = async_[key], sync[key]
    speedup = (a / s if higher_is_better else s / a) if a and s else None
    return {
        "metric": key,
        "sync": s,
        "async": a,
        "async_speedup": speedup,
        "sync_executor": sync.get("executor"),
        "async_executor": async_.get("executor"),
    }


def print_comparison(c: dict, unit: str) -> None:
    print("{s:{c}^64}".format(s=" Sync vs async (one process, same workload) ", c="="))
    print(f"{'sync (' + str(c['sync_executor']) + ' executor):':<44}{c['sync']:>14.3f} {unit}")
    print(f"{'async (' + str(c['async_executor']) + ' executor):':<44}{c['async']:>14.3f} {unit}")
    speedup = "n/a" if c["async_speedup"] is None else f"{c['async_speedup']:.3f}x"
    print(f"{'Async speedup over sync:':<44}{speedup:>14}")
    print("=" * 64)


def mode_fields(config) -> dict:
    """Which mode and executor a run used (the result JSON says so)."""
    return {
        "async_scheduling": config.async_scheduling,
        "executor": config.parallel.distributed_executor_backend,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
    }
