"""Executors: how the engine core reaches its workers (in process or in worker processes)."""

from __future__ import annotations

from vserve.config import EngineConfig
from vserve.executor.base import Executor, StepFuture


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel.distributed_executor_backend == "mp":
        from vserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from vserve.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)


__all__ = ["Executor", "StepFuture", "make_executor"]
