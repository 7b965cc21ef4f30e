"""Engine-core clients: how a front end reaches the engine core.

`InprocClient` runs the core in the caller's process and steps it on demand (tests,
debugging). `SyncMPClient` and `AsyncMPClient` (in `mp_client.py`) talk to an
`EngineCoreProc` in its own process over ZMQ. The protocols below are what the front ends
rely on: `LLMEngine` takes any `EngineCoreClient`, `AsyncLLM` an `AsyncEngineCoreClient`.
A utility call means the same everywhere: the engine core's `call_utility`, whose value comes
back as msgpack carries it (in process too).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec

from vserve.config import EngineConfig
from vserve.engine.core import EngineCore
from vserve.engine.messages import EngineCoreOutputs, EngineCoreRequest
from vserve.executor.base import Executor


class EngineCoreClient(Protocol):
    """A synchronous front end's view of the engine core."""

    num_kv_blocks: int

    def add_requests(
        self, requests: list[EngineCoreRequest], data_parallel_rank: int | None = None
    ) -> int:
        """Send one prompt's requests (its `n` children) to an engine (data parallel: the
        least loaded one, or `data_parallel_rank`), in one message; returns its rank."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks until one commits)."""
        ...

    def call_utility(self, method: str, *args: Any) -> Any: ...

    def process_memory(self) -> dict[str, int]:
        """Resident bytes of each process the engine runs besides the caller's."""
        ...

    def shutdown(self) -> None: ...


class AsyncEngineCoreClient(Protocol):
    """An asyncio front end's view of the engine core (the same calls, awaited)."""

    num_kv_blocks: int

    def start(self) -> None:
        """Bind to the running event loop (call from inside it)."""
        ...

    async def add_requests_async(
        self, requests: list[EngineCoreRequest], data_parallel_rank: int | None = None
    ) -> int: ...

    async def abort_requests_async(self, request_ids: list[str]) -> None: ...

    async def get_output_async(self) -> EngineCoreOutputs: ...

    async def call_utility_async(self, method: str, *args: Any) -> Any: ...

    def shutdown(self) -> None: ...


class InprocClient:
    """An `EngineCoreClient` with the engine core in this process."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.core = EngineCore(config, executor)
        self.num_kv_blocks = self.core.num_kv_blocks
        self.engine_index = config.data_parallel.engine_index  # external LB: the rank served
        self.num_adds = 0  # so that an abort never reaches a later request of the same id

    def add_requests(
        self, requests: list[EngineCoreRequest], data_parallel_rank: int | None = None
    ) -> int:
        if data_parallel_rank not in (None, self.engine_index):
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank}: this is engine {self.engine_index}"
            )
        self.num_adds += 1
        for request in requests:
            self.core.add_request(request, self.num_adds)
        return self.engine_index

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids, self.num_adds)
            # at once (this thread runs the steps): a request the front end ended (a stop
            # string) frees its KV blocks even when no later step comes to apply the abort
            self.core.apply_aborts()

    def get_output(self) -> EngineCoreOutputs:
        """Step until a step commits (or nothing is left to do)."""
        outputs = []
        while self.core.has_work():
            if self.core.waiting_for_grammars():
                self.core.structured.wait_compiled(timeout=1.0)
                continue
            step = self.core.step_fn()
            if step is not None:
                outputs = step
                break
        return EngineCoreOutputs(outputs, self.core.make_stats(), time.time())

    def call_utility(self, method: str, *args: Any) -> Any:
        value = self.core.call_utility(method, *args)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(value))  # as the wire gives it

    def process_memory(self) -> dict[str, int]:
        """The worker processes (if any): the engine core is the caller's own process."""
        return self.core.executor.worker_memory()

    def shutdown(self) -> None:
        self.core.shutdown()
