"""What the completion and chat handlers share once a request is prepared
(`request_prep.py`): the server context, SSE events, admission to the engine (the queue
limit), submitting prompts, and reading their outputs until done or disconnected.

Every request registered here is aborted in the engine when its handler ends for any reason
(finished, client gone, error, server drain, `--request-timeout`), so no KV block outlives
its HTTP request.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel

from vserve.engine.async_llm import AsyncLLM
from vserve.engine.output_processor import RequestState
from vserve.entrypoints.openai.errors import APIError, error_body, error_status
from vserve.entrypoints.openai.limits import AdmissionLimits
from vserve.entrypoints.openai.protocol import random_id
from vserve.entrypoints.openai.tool_settings import ToolSettings
from vserve.outputs import OutputKind, RequestOutput
from vserve.sampling_params import SamplingParams

SSE_DONE = "data: [DONE]\n\n"
logger = logging.getLogger("vserve.server")


def sse_event(chunk: BaseModel) -> str:
    # like vLLM, chunks carry `usage` only when it is set (the final usage chunk, or with
    # continuous_usage_stats); `finish_reason: null` and the like stay
    exclude = {"usage"} if getattr(chunk, "usage", True) is None else None
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the 200 status went out: an error event (the stream then ends)."""
    status, message = error_status(exc)
    if status == 500 and not isinstance(exc, APIError):
        logger.error("request failed while streaming", exc_info=exc)
    return f"data: {json.dumps(error_body(status, message))}\n\n"


@dataclass
class ServerContext:
    """State of one running server, shared by every handler."""

    engine: AsyncLLM
    served_model_names: list[str]
    chat_template: str | None = None
    model_aliases: list[str] = field(default_factory=list)  # accepted, never listed
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    tools: ToolSettings = field(default_factory=ToolSettings)
    reasoning_parser: str | None = None  # --reasoning-parser (reasoning.py)
    structured_in_reasoning: bool = False  # --structured-outputs-in-reasoning
    draining: bool = False
    exit_code: int = 0
    active: dict[str, RequestState] = field(default_factory=dict)  # engine id -> state
    deadlines: dict[str, asyncio.TimerHandle] = field(default_factory=dict)  # --request-timeout
    num_active_seqs: int = 0
    request_exit: Callable[[int], None] = lambda code: None
    # one thread: HF fast tokenizers are not safe to call from several threads at once
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="vserve-tokenizer")
    )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def num_engines(self) -> int:
        """Engines behind this server (data parallel over one front end; else 1)."""
        dp = getattr(self.engine.config, "data_parallel", None)
        return dp.size if dp is not None and dp.rank is None else 1

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    def check_model(self, model: str | None) -> None:
        if (
            model is not None
            and model not in self.served_model_names
            and model not in self.model_aliases
        ):
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def off_loop(self, fn: Callable, *args, **kwargs):
        """Tokenizer work (encoding, chat templates, long decodes) on the tokenizer thread, so
        that the event loop keeps answering /health and feeding streams meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_pool, functools.partial(fn, *args, **kwargs)
        )

    def admit(self, num_seqs: int) -> None:
        """Refuse when the waiting queue would exceed --max-num-queued-reqs. The count is the
        front end's own (sequences in flight beyond max_num_seqs), exact at admission time."""
        if self.draining:
            raise APIError(503, "The server is shutting down.")
        limit = self.limits.max_num_queued_reqs
        max_running = self.engine.config.scheduler.max_num_seqs * self.num_engines
        queued = self.num_active_seqs + num_seqs - max_running
        if queued > limit:
            raise APIError(
                503,
                f"The server is overloaded: the waiting queue is full "
                f"({limit} requests). Retry later.",
                headers={"Retry-After": "1"},
            )


async def submit(
    ctx: ServerContext,
    prompts: list[tuple[str | None, list[int]]],
    params: list[SamplingParams],
    base_id: str,
    rank: int | None = None,
) -> list[RequestState]:
    """Add one engine request per prompt, on data-parallel engine `rank` if given; all or
    none (a failure aborts the ones added)."""
    states: list[RequestState] = []
    ctx.admit(sum(p.n for p in params))
    try:
        for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
            prompt = (
                {"prompt": text, "prompt_token_ids": ids} if text else {"prompt_token_ids": ids}
            )
            rid = f"{base_id}-{i}-{random_id()[:8]}"  # unique even if X-Request-Id repeats
            state = await ctx.engine.add_request(prompt, sp, rid, OutputKind.DELTA, rank)
            states.append(state)
            ctx.active[rid] = state
            ctx.num_active_seqs += sp.n
            _set_deadline(ctx, rid)
    except ValueError as e:
        release(ctx, states)
        raise APIError(400, str(e)) from e
    except BaseException:
        release(ctx, states)
        raise
    return states


def release(ctx: ServerContext, states: list[RequestState]) -> None:
    """Abort whatever is unfinished (a no-op for finished requests) and forget the states."""
    for state in states:
        if ctx.active.pop(state.request_id, None) is not None:
            ctx.num_active_seqs -= state.params.n
        timer = ctx.deadlines.pop(state.request_id, None)
        if timer is not None:
            timer.cancel()
        ctx.engine.abort_nowait(state.request_id)


def _set_deadline(ctx: ServerContext, request_id: str) -> None:
    """--request-timeout: abort the request in the engine when it expires; its stream then
    ends with finish_reason "abort", as in a drain."""
    timeout = ctx.limits.request_timeout
    if timeout is None:
        return

    def expire() -> None:
        ctx.deadlines.pop(request_id, None)
        if request_id in ctx.active:
            logger.info(
                "request %s ran past --request-timeout (%.1f s); aborting it", request_id, timeout
            )
            asyncio.ensure_future(ctx.engine.abort(request_id))

    ctx.deadlines[request_id] = asyncio.get_running_loop().call_later(timeout, expire)


async def iterate(
    ctx: ServerContext, states: list[RequestState]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every request until all finish; aborts them on exit."""
    try:
        if len(states) == 1:
            async for out in ctx.engine.stream(states[0]):
                yield 0, out
            return
        async for item in _merge(ctx, states):
            yield item
    finally:
        release(ctx, states)


async def _merge(
    ctx: ServerContext, states: list[RequestState]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    # bounded: a pump whose item is not yet taken stops pulling, so a slow reader leaves the
    # outputs pending in the engine's per-request collectors, where deltas merge
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(states))

    async def pump(index: int, state: RequestState) -> None:
        try:
            async for out in ctx.engine.stream(state):
                await queue.put((index, out))
            await queue.put((index, None))
        except Exception as e:  # noqa: BLE001 -- re-raised by the reader below
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnect(raw: Request, work: Awaitable):
    """Run `work` unless the client disconnects first; then cancel it (which aborts its
    engine requests) -- the ASGI disconnect message works behind any pure-ASGI middleware."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        await asyncio.wait({task})  # let its cleanup (engine aborts) run
    if task.cancelled():
        raise APIError(499, "client disconnected")
    return task.result()


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class TokenStrings:
    """Token id -> its text (logprob entries name tokens by their decoded text). The most
    recently used `size` are cached: a cache of every token seen grows for as long as the
    server runs, towards the whole vocabulary (Gemma's 262k tokens: tens of MB)."""

    def __init__(self, tokenizer, size: int = 16384) -> None:
        self.tokenizer = tokenizer
        self.decode = functools.lru_cache(maxsize=size)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def __call__(self, token_id: int) -> str:
        return self.decode(token_id)
