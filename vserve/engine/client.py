"""Engine-core clients: how a front end reaches the engine core.

`InprocClient` runs the core in the caller's process and steps it on demand (tests,
debugging). `SyncMPClient` and `AsyncMPClient` (in `mp_client.py`) talk to an
`EngineCoreProc` in its own process over ZMQ; all three offer the same calls.
"""

from __future__ import annotations

import time

from vserve.config import EngineConfig
from vserve.engine.core import EngineCore
from vserve.engine.messages import EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    def __init__(self, config: EngineConfig, executor=None) -> None:
        self.core = EngineCore(config, executor)
        self.num_kv_blocks = self.core.num_kv_blocks
        self.num_adds = 0   # so that an abort never reaches a later request of the same id

    def add_request(self, request: EngineCoreRequest) -> None:
        self.num_adds += 1
        self.core.add_request(request, self.num_adds)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids, self.num_adds)

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

    def call_utility(self, method: str, *args):
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()
