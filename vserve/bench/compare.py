"""`--compare-sync` of `vserve bench throughput | latency`: the same workload run three times in
one process, async scheduling off, on, then off again, every other engine argument the same.
Async is compared with the mean of the two sync runs, so a machine that drifts (or a one-time
cost in the first engine of the process) moves both sides alike; the two sync runs' ratio is
reported as the drift. Every engine takes the same untimed warm-up first. That
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


def run_modes(run_one: Callable, engine_args: EngineArgs):
    """`run_one(engine_args, calibration) -> (result, records, ...)`: sync, async, sync; the
    first sync run's records calibrate the async run. Returns the three runs' tuples."""
    sync_args, async_args = mode_engine_args(engine_args)
    first = run_one(sync_args, None)
    middle = run_one(async_args, first[1])
    return first, middle, run_one(sync_args, None)


def run_maybe_compared(
    args, engine_args: EngineArgs, run_one: Callable, key: str, higher_is_better: bool, unit: str
):
    """`run_one(args, engine_args, calibration=None) -> (result, records, spans)` once, or
    sync, async, sync with `--compare-sync` (the async run's tuple, its result gaining
    `compare_sync` on `key`)."""
    if not args.compare_sync:
        return run_one(args, engine_args)
    first, (result, records, spans), second = run_modes(
        lambda ea, calibration: run_one(args, ea, calibration), engine_args
    )
    result["compare_sync"] = comparison([first[0], second[0]], result, key, higher_is_better)
    result["compare_sync"]["sync_result"] = first[0]
    result["compare_sync"]["second_sync_result"] = second[0]
    print_comparison(result["compare_sync"], unit)
    return result, records, spans


def comparison(syncs: list[dict], async_: dict, key: str, higher_is_better: bool) -> dict:
    """Async's speedup on one figure over the mean of the sync runs' figures, and the sync
    runs' drift (the last over the first)."""
    figures = [r[key] for r in syncs]
    a, s = async_[key], sum(figures) / len(figures)
    speedup = (a / s if higher_is_better else s / a) if a and s else None
    return {
        "metric": key,
        "sync": s,
        "sync_runs": figures,
        "sync_drift": figures[-1] / figures[0] if figures[0] else None,
        "async": a,
        "async_speedup": speedup,
        "sync_executor": syncs[0].get("executor"),
        "async_executor": async_.get("executor"),
    }


def print_comparison(c: dict, unit: str) -> None:
    print("{s:{c}^64}".format(s=" Sync vs async (one process, same workload) ", c="="))
    runs = ", ".join(f"{v:.3f}" for v in c["sync_runs"])
    print(
        f"{'sync (' + str(c['sync_executor']) + ' executor), mean:':<44}{c['sync']:>14.3f} {unit}"
    )
    print(f"{'  sync runs, before and after async:':<44}{runs:>14}")
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
