"""The synchronous front end behind `LLM`: processor + engine-core client + output processor.

The client's threads reference the client, never this object, so an `LLMEngine` that nobody
uses any more is collected at once, and its finalizer shuts the engine core and workers down
(as `shutdown()` does, and as the interpreter's exit does for one still alive)."""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING

from vserve.config import EngineConfig
from vserve.engine.arg_utils import EngineArgs
from vserve.engine.messages import SchedulerStats
from vserve.engine.output_processor import OutputProcessor
from vserve.engine.processor import InputProcessor, Prompt
from vserve.engine.recorder import StepRecord
from vserve.outputs import OutputKind, RequestOutput
from vserve.sampling_params import SamplingParams
from vserve.startup import phase, resident_bytes, start_with_tokenizer

if TYPE_CHECKING:  # the in-process client is imported only when used
    from vserve.engine.client import EngineCoreClient

logger = logging.getLogger("vserve")


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess: bool = False) -> None:
        self.config = config
        self.client: EngineCoreClient
        self.tokenizer, self.client = start_with_tokenizer(
            config.model.tokenizer, lambda: _make_client(config, multiprocess)
        )
        self.processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        self.last_stats: SchedulerStats | None = None
        self.detokenize_spans: list[tuple[float, float]] = []  # front-end lane of the trace

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = False) -> LLMEngine:
        with phase("config", "frontend"):
            config = args.create_engine_config()
        return cls(config, multiprocess)

    def process_memory(self) -> dict[str, int]:
        """Resident bytes of each process: this one, and the engine core and workers when
        they run in their own."""
        return {"frontend": resident_bytes(), **self.client.process_memory()}

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        kind: OutputKind = OutputKind.FINAL_ONLY,
        data_parallel_rank: int | None = None,
    ) -> None:
        text, ids = self.processor.tokenize_prompt(prompt)
        requests = self.processor.make_requests(request_id, ids, params)
        self.output_processor.add_request(
            request_id,
            text,
            ids,
            params,
            [r.request_id for r in requests],
            kind,
            incarnations=[r.incarnation for r in requests],
        )
        try:  # an n > 1 request's samples share one engine and one message
            self.client.add_requests(requests, data_parallel_rank)
        except BaseException:  # not admitted: forget its state (nothing was sent)
            self.output_processor.abort_request(request_id)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.client.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outs = self.client.get_output()
        if outs.engine_error:
            failed = self.output_processor.fail_all(outs.engine_error)
            from vserve.engine.mp_client import EngineDeadError

            raise EngineDeadError(outs.engine_error, [ro for _, ro in failed])
        self.last_stats = outs.scheduler_stats
        start = time.perf_counter()
        delivered, to_abort = self.output_processor.process_outputs(outs.outputs)
        if outs.outputs and len(self.detokenize_spans) < 100_000:
            self.detokenize_spans.append((start, time.perf_counter()))
        if to_abort:
            self.client.abort_requests(to_abort)
        return [ro for _, ro in delivered]

    def take_step_records(self) -> list[StepRecord]:
        """Per-step timestamps recorded by the engine core since the last call."""
        return [StepRecord(**r) for r in self.client.call_utility("take_step_records")]

    def take_detokenize_spans(self) -> list[tuple[float, float]]:
        spans, self.detokenize_spans = self.detokenize_spans, []
        return spans

    def shutdown(self) -> None:
        self._finalizer()


def _make_client(config: EngineConfig, multiprocess: bool) -> EngineCoreClient:
    if multiprocess:
        from vserve.engine.dp.client import make_sync_client

        return make_sync_client(config)
    if config.data_parallel.size > 1 and config.data_parallel.rank is None:
        raise ValueError(
            "data_parallel_size > 1 runs engines in their own processes: multiprocess=True"
        )
    from vserve.engine.client import InprocClient

    return InprocClient(config)
