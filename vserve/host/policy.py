"""How vserve uses the host beside the model: every decision about the CPUs, threads and heaps
of the engine core and the workers, made once, in one place, from the device, the engine's
config and the environment (`vserve.envs`).

| decision                                          | when                               |
|---------------------------------------------------|------------------------------------|
| the front end's CPU time counts with the engine   | one local engine beside its front  |
|   core's in core placement (`placement_control`)  |   end                              |
| the engine core yields its core when it wakes     | async scheduling, workers in their |
|   (`affinity.yield_on_wakeup`)                    |   own processes                    |
| a worker's threads sleep between forwards while   | CPU, one worker rank, and          |
|   its host work runs (`workers/host_gap.py`)      |   `VSERVE_CPU_PARK` not 0          |
| a worker sends its reply inline (no reply thread) | CPU, PP=1, rank 0                  |
| a worker takes its next request ahead of its      | CPU, a rank fed by another (PP)    |
|   forward (`workers/pp_prefetch.py`)              |                                    |
| the heap keeps freed pages while stepping, and    | every worker; the engine core and  |
|   is trimmed at the end of start-up and at idle   |   front end trim after start-up    |
|   (`heap.py`)                                     |                                    |

Why each one pays, with measurements: `docs/cpu_kernels.md` and `docs/configuration.md`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vserve.config import EngineConfig
from vserve.envs import ENV, Env
from vserve.host import heap
from vserve.host.affinity import yield_on_wakeup


@dataclass(frozen=True)
class WorkerHost:
    """What one worker rank does on its host."""

    park_gaps: bool
    inline_replies: bool
    prefetch_requests: bool


@dataclass(frozen=True)
class HostPolicy:
    """The engine core's side (`apply_to_engine_core`) and the workers' (`worker`)."""

    device: str
    count_front_end: bool
    yield_engine_core: bool

    @classmethod
    def of(cls, config: EngineConfig, remote: bool = False) -> HostPolicy:
        """`remote`: the engine core serves a head on another host (its front end is not
        beside it)."""
        separate_workers = config.parallel.distributed_executor_backend != "uni"
        return cls(
            device=config.device.device,
            count_front_end=config.data_parallel.size_local <= 1 and not remote,
            yield_engine_core=config.async_scheduling and separate_workers,
        )

    def apply_to_engine_core(self, executor, front_end_pid: int) -> None:
        """In the engine core's process, once its executor and workers have started."""
        if self.count_front_end:
            executor.add_host_process(front_end_pid)  # the front end works beside the forward
        if self.yield_engine_core:
            # woken by a reply, this process preempted the worker's forward thread on its core
            # (the measurement: docs/configuration.md, "Scheduling and CPU placement"); its own
            # process only, so an engine core inside the caller's process leaves it alone
            yield_on_wakeup(os.getpid())
        heap.startup_over()

    @staticmethod
    def worker(device: str, rank: int, pp_size: int, world_size: int, env: Env = ENV) -> WorkerHost:
        """One worker rank's part (a worker process has no engine config, only its own)."""
        cpu = device == "cpu"
        return WorkerHost(
            park_gaps=cpu and env.cpu_park and world_size == 1,
            inline_replies=cpu and pp_size == 1 and rank == 0,
            prefetch_requests=cpu and world_size > 1 and rank > 0,
        )
