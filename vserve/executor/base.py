"""What every executor offers the engine core, and the futures it hands out."""

from __future__ import annotations

from vserve.config import EngineConfig
from vserve.core.sched_output import RunnerOutput, SchedulerOutput
from vserve.workers.model_runner import RunnerConfig


class StepFuture:
    """The result of one `execute_model(..., non_block=True)`; `result()` may block."""

    def __init__(self, resolve) -> None:
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
        return self._value

    def done(self) -> bool:
        return self._done


class Executor:
    def num_kv_blocks(self) -> int:
        raise NotImplementedError

    def init_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, so: SchedulerOutput, non_block: bool = False,
                      defer_sampling: bool = False):
        """Launch a step; with `defer_sampling` only its forward (no reply until
        `sample_tokens`)."""
        raise NotImplementedError

    def sample_tokens(self, so: SchedulerOutput, non_block: bool = False):
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def worker_memory(self) -> dict[str, int]:
        """Resident bytes of each worker process ({} when the workers run in this one)."""
        return {}

    def shutdown(self) -> None:
        pass


def runner_config(config: EngineConfig, pp_rank: int = 0) -> RunnerConfig:
    m, c, s, d = config.model, config.cache, config.scheduler, config.device
    return RunnerConfig(
        model_path=m.model, dtype=m.dtype, max_model_len=m.max_model_len,
        max_num_seqs=s.max_num_seqs, block_size=c.block_size, device=d.device,
        attention_backend=d.attention_backend, pp_rank=pp_rank,
        pp_size=config.parallel.pipeline_parallel_size,
        layer_partition=config.parallel.layer_partition,
        kv_cache_memory_bytes=c.kv_cache_memory_bytes,
        gpu_memory_utilization=c.gpu_memory_utilization,
        num_gpu_blocks_override=c.num_gpu_blocks_override, enforce_eager=d.enforce_eager,
        sliding_window=c.sliding_window, local_block_cap=config.local_block_cap)


__all__ = ["Executor", "StepFuture", "runner_config"]
