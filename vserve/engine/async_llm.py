"""`AsyncLLM`: the asyncio front end (HTTP server) over a multiprocess engine core.

`generate()` is an async generator of `RequestOutput`s for one request. Cancelling it (a
client that disconnected) or closing it early aborts the request in the engine, so its KV
blocks come back. One output-handler task reads the engine's outputs, detokenizes, and feeds
per-request queues. If the engine core dies, every pending request gets `EngineDeadError`
and so does every new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from vserve.config import EngineConfig
from vserve.engine.arg_utils import EngineArgs
from vserve.engine.dp.client import make_async_client
from vserve.engine.messages import SchedulerStats
from vserve.engine.mp_client import EngineDeadError
from vserve.engine.output_collector import OutputCollector
from vserve.engine.output_processor import OutputProcessor, RequestState
from vserve.engine.processor import InputProcessor, Prompt
from vserve.host import heap
from vserve.outputs import OutputKind, RequestOutput
from vserve.sampling_params import SamplingParams
from vserve.startup import phase, resident_bytes, start_with_tokenizer

if TYPE_CHECKING:
    from vserve.engine.client import AsyncEngineCoreClient

logger = logging.getLogger("vserve")


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.client: AsyncEngineCoreClient
        self.tokenizer, self.client = start_with_tokenizer(
            config.model.tokenizer, lambda: make_async_client(config)
        )
        self.processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.dead_error: str | None = None
        self.last_stats: SchedulerStats | None = None
        # (stats, the data-parallel rank of the engine that sent them)
        self.stats_listeners: list[Callable[[SchedulerStats, int], None]] = []
        self.output_listeners: list[Callable[[RequestState, RequestOutput], None]] = []
        self._handler: asyncio.Task | None = None
        self._trimmer: asyncio.Task | None = None
        self._num_deliveries = 0  # output batches delivered (the heap trimmer watches it)
        self._pending_aborts: list[str] = []  # sent before the next ADD, in order

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        with phase("config", "frontend"):
            config = args.create_engine_config()
        return cls(config)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def num_unfinished(self) -> int:
        return len(self.output_processor.requests)

    # -- requests ----------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        kind: OutputKind = OutputKind.DELTA,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        state = await self.add_request(prompt, params, request_id, kind, data_parallel_rank)
        async for out in self.stream(state):
            yield out

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        kind: OutputKind = OutputKind.DELTA,
        data_parallel_rank: int | None = None,
    ) -> RequestState:
        """Validate and submit; raises ValueError for bad input (a `data_parallel_rank` that
        names no live engine, too), EngineDeadError if dead. The engine is the least loaded
        one unless `data_parallel_rank` names it; an n > 1 request's samples share it."""
        self._start()
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        text, ids = self.processor.tokenize_prompt(prompt)
        requests = self.processor.make_requests(request_id, ids, params)
        state = self.output_processor.add_request(
            request_id,
            text,
            ids,
            params,
            [r.request_id for r in requests],
            kind,
            queue=OutputCollector(kind),  # slow readers pin one (merged) output
            incarnations=[r.incarnation for r in requests],
        )
        try:
            await self._flush_aborts()  # an earlier request of this id is aborted first
            # one message: its n children (and their constraint, once) reach one engine
            state.engine_index = await self.client.add_requests_async(requests, data_parallel_rank)
        except BaseException:  # not admitted: forget its state (nothing was sent)
            self.output_processor.abort_request(request_id)
            raise
        return state

    async def stream(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await _queue(state).get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort_nowait(state.request_id)

    def abort_nowait(self, request_id: str) -> None:
        self._queue_aborts(self._abort_state(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort from outside the consumer (server drain): its stream ends with one last output
        whose unfinished choices have finish_reason 'abort'."""
        self._queue_aborts(self._abort_state(request_id))
        await self._flush_aborts()

    def _queue_aborts(self, ids: list[str]) -> None:
        """Aborts go out from a task, but always before any later ADD (which may reuse an
        id): the engine core would refuse an ADD for an id that is still live."""
        if not ids or self.dead_error is not None:
            return
        if not self._pending_aborts:
            asyncio.get_running_loop().create_task(self._flush_aborts())
        self._pending_aborts.extend(ids)

    async def _flush_aborts(self) -> None:
        ids, self._pending_aborts = self._pending_aborts, []
        if ids and self.dead_error is None:
            try:
                await self.client.abort_requests_async(ids)
            except EngineDeadError:
                pass  # every request has its error already

    def _abort_state(self, request_id: str) -> list[str]:
        # listeners see every request finish, aborts included (metrics count them), and a
        # consumer still reading the stream gets a final output instead of waiting forever
        state = self.output_processor.requests.get(request_id)
        ids = self.output_processor.abort_request(request_id)
        if state is not None:
            for child in state.children.values():
                if child.finish_reason is None:
                    child.finish_reason = "abort"
            out = self.output_processor.make_output(state)
            assert out is not None  # every choice is finished
            _queue(state).put_nowait(out)
            for listener in self.output_listeners:
                listener(state, out)
        return ids

    # -- engine ------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._handler is None:
            self.client.start()
            loop = asyncio.get_running_loop()
            self._handler = loop.create_task(self._output_handler())
            self._trimmer = loop.create_task(heap.trim_when_idle(lambda: self._num_deliveries))

    async def _output_handler(self) -> None:
        """Delivers outputs until the engine dies. An unexpected error here (a listener, the
        detokenizer) would stop delivery for every request: it marks the engine dead
        instead, so requests fail, /health turns 503 and the server exits non-zero."""
        try:
            while True:
                outs = await self.client.get_output_async()
                if outs.engine_error:
                    self._fail(outs.engine_error)
                    return
                self._deliver(outs)
        except Exception as e:  # noqa: BLE001 -- see above
            logger.exception("the output handler failed")
            self._fail(f"the front end's output handler failed: {type(e).__name__}: {e}")

    def _deliver(self, outs) -> None:
        self._num_deliveries += 1
        if outs.scheduler_stats is not None:
            self.last_stats = outs.scheduler_stats
            for on_stats in self.stats_listeners:
                on_stats(outs.scheduler_stats, outs.engine_index)
        delivered, to_abort = self.output_processor.process_outputs(outs.outputs)
        for state, out in delivered:
            _queue(state).put_nowait(out)
            for listener in self.output_listeners:
                listener(state, out)
        self._queue_aborts(to_abort)

    def _fail(self, message: str) -> None:
        self.dead_error = message
        error = EngineDeadError(message)
        for state in list(self.output_processor.requests.values()):
            _queue(state).put_nowait(error)
        self.output_processor.clear()

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    async def call_utility(self, method: str, *args):
        self._start()
        return await self.client.call_utility_async(method, *args)

    async def call_utility_each(self, method: str, *args) -> dict[int, object]:
        """The answer of every live engine, by data-parallel rank."""
        self._start()
        each = getattr(self.client, "call_utility_each_async", None)
        if each is not None:
            return await each(method, *args)
        rank = getattr(self.client, "engine_index", 0)
        return {rank: await self.client.call_utility_async(method, *args)}

    async def process_memory(self) -> dict[str, int]:
        """Resident bytes of this process, the engine core and each worker."""
        return {"frontend": resident_bytes(), **await self.call_utility("process_memory")}

    def shutdown(self) -> None:
        for task in (self._handler, self._trimmer):
            if task is not None:
                task.cancel()
        self.client.shutdown()


def _queue(state: RequestState) -> OutputCollector:
    assert state.queue is not None  # AsyncLLM gives every request one
    return state.queue
