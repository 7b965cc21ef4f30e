"""The model runner in the engine core's own process. On CUDA the forward still overlaps the
next schedule (kernels run asynchronously and the host copy is awaited in `result()`); on CPU
it runs inline. Used for tests, debugging and single-device serving."""

from __future__ import annotations

from vserve.config import EngineConfig
from vserve.core.sched_output import RunnerOutput, SchedulerOutput
from vserve.executor.base import Executor, StepFuture
from vserve.workers.runner_config import RunnerConfig
from vserve.workers.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(RunnerConfig.of(config))
        self.worker.load_model()

    def num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, so: SchedulerOutput, defer_sampling: bool = False) -> StepFuture | None:
        out = self.worker.execute_model(so, defer_sampling)
        return None if defer_sampling else StepFuture(lambda timeout: out.get())

    def sample_tokens(self, so: SchedulerOutput) -> StepFuture:
        out = self.worker.sample_tokens(so.step_id, so.grammar_bitmask)
        return StepFuture(lambda timeout: out.get())

    @property
    def runner(self):
        return self.worker.runner


__all__ = ["UniProcExecutor", "RunnerOutput"]
