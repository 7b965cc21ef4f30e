"""What every executor offers the engine core, and the futures it hands out.

The engine core launches steps through `execute_model` (and, for a step whose sampling waits
for a grammar bitmask, `sample_tokens`) and collects each step's `RunnerOutput` from its
`StepFuture`, in launch order. The uni-process executor runs the worker in this process; the
multiprocess one runs a worker process per local pipeline stage.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from vserve.core.sched_output import RunnerOutput, SchedulerOutput


class StepFuture:
    """The result of one launched step; `result()` may block."""

    def __init__(self, resolve: Callable[[float | None], RunnerOutput]) -> None:
        self._resolve = resolve
        self._done = False
        self._value: RunnerOutput | None = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None) -> RunnerOutput:
        if not self._done:
            try:
                self._value = self._resolve(timeout)
            except BaseException as e:
                self._error = e
            self._done = True
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def done(self) -> bool:
        return self._done


class Executor(abc.ABC):
    # called from another thread when a worker dies (the engine core process sets it)
    on_failure: Callable[[str], None] | None = None

    @abc.abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks the workers can hold (the smallest over the stages)."""

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def execute_model(self, so: SchedulerOutput, defer_sampling: bool = False) -> StepFuture | None:
        """Launch a step; its future, or None with `defer_sampling` (only the forward runs:
        the step's result comes from `sample_tokens`)."""

    @abc.abstractmethod
    def sample_tokens(self, so: SchedulerOutput) -> StepFuture:
        """Sample a deferred step, with the grammar bitmask (`so.grammar_bitmask`) known now."""

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def worker_memory(self) -> dict[str, int]:
        """Resident bytes of each worker process ({} when the workers run in this one)."""
        return {}

    def add_host_process(self, pid: int) -> None:
        """A process whose CPU time is host work beside the forward (core placement); nothing
        to do when the workers run in the engine core's process."""

    def shutdown(self) -> None:
        """Stop the workers and free their memory."""


__all__ = ["Executor", "StepFuture"]
