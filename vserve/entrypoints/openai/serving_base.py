"""What the completion and chat handlers share: the server context, SSE events, admission
(model name, the limits of `limits.py`, context length, queue limit), tokenization on the
tokenizer thread, sampling parameters from a request, submitting prompts to the engine, and
reading their outputs until done or disconnected.

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

from vserve.core.outputs import ERROR_BUSY, ERROR_DEAD, ERROR_INVALID
from vserve.engine.async_llm import AsyncLLM
from vserve.engine.output_processor import OutputKind, RequestState
from vserve.engine.processor import check_text
from vserve.entrypoints.openai.errors import APIError, error_body, error_status
from vserve.entrypoints.openai.limits import AdmissionLimits
from vserve.entrypoints.openai.protocol import SamplingRequest, random_id
from vserve.entrypoints.openai.tool_calls import ToolSettings
from vserve.outputs import CompletionOutput, RequestOutput
from vserve.sampling_params import SamplingParams, StructuredOutputsParams

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


def check_request(ctx: ServerContext, req: SamplingRequest, num_prompts: int) -> None:
    """What can be refused from the parsed body alone, before any tokenization."""
    ctx.check_model(req.model)
    ctx.limits.check_fan_out(num_prompts, req.n)
    ctx.limits.check_stops(req.stop, req.stop_token_ids)
    ctx.limits.check_logit_bias(req.logit_bias)


def data_parallel_rank(raw: Request) -> int | None:
    """The engine a request names in its `X-data-parallel-rank` header (vLLM's), if any."""
    value = raw.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"X-data-parallel-rank must be an integer, got {value!r:.40}") from None


def base_request_id(raw: Request) -> str:
    return getattr(raw.state, "request_id", None) or random_id()


def check_context(ctx: ServerContext, prompt_len: int, max_tokens: int | None) -> int:
    """The number of tokens a request may generate; 400 when prompt + output does not fit."""
    limit = ctx.max_model_len
    if max_tokens is None:
        if prompt_len >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. "
                f"However, your prompt contains {prompt_len} tokens, which leaves "
                "no room for output. Please reduce the length of the input.",
                "messages",
            )
        return limit - prompt_len
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, "
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
            f"input, {max_tokens} in the completion). Please reduce the length of "
            "the input or the completion.",
            "max_tokens",
        )
    return max_tokens


_PARAM_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)


def make_sampling_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's sampling params; `constraint` (made once per request by
    `prepare_constraint`) is shared by every prompt's params, never copied."""
    kwargs = {name: getattr(req, name) for name in _PARAM_FIELDS if getattr(req, name) is not None}
    kwargs.update(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logit_bias=_logit_bias(req.logit_bias),
        structured_outputs=constraint,
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param if param in type(req).model_fields else None) from e


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError as e:
        raise APIError(
            400, "logit_bias keys must be token ids (integers written as strings)", "logit_bias"
        ) from e


async def prepare_constraint(
    ctx: ServerContext, make: Callable[[], StructuredOutputsParams | None]
) -> StructuredOutputsParams | None:
    """A request's structured-output constraint, made and checked once (its size against
    --max-constraint-chars, then that it parses) on a worker thread: its text may be long."""

    def prepare() -> StructuredOutputsParams | None:
        try:
            constraint = make()
            if constraint is not None:
                ctx.engine.processor.check_constraint(constraint)
            return constraint
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "structured_outputs") from e

    return await asyncio.to_thread(prepare)


def check_params(ctx: ServerContext, params: SamplingParams, prompt_len: int) -> None:
    """The engine's own checks (logprobs cap, token ids in vocabulary); the constraint was
    checked once by `prepare_constraint`, so this costs no more than the small params."""
    try:
        ctx.engine.processor.check_params(params, prompt_len)
    except ValueError as e:
        raise APIError(400, str(e)) from e


def check_prompt_sizes(ctx: ServerContext, prompts: list[str | list[int]]) -> None:
    """What the prompts' sizes alone decide, before any is tokenized: no empty prompt, each
    text within --max-prompt-chars, all texts within --max-request-chars, all token ids
    within --max-request-tokens."""
    limits, max_len = ctx.limits, ctx.max_model_len
    num_chars = num_ids = 0
    for prompt in prompts:
        if not prompt:
            what = "must not be empty" if isinstance(prompt, str) else "must be a non-empty list"
            raise APIError(400, f"prompt {what}", "prompt")
        if isinstance(prompt, str):
            limits.check_prompt_chars(len(prompt), max_len, "prompt")
            num_chars += len(prompt)
        else:
            if len(prompt) >= max_len:
                check_context(ctx, len(prompt), None)  # raises: no room for output
            num_ids += len(prompt)
    limits.check_request_chars(num_chars, max_len, "prompt")
    limits.check_request_tokens(num_ids, max_len)


def tokenize_all(
    ctx: ServerContext,
    prompts: list[str | list[int]],
    add_special_tokens: bool,
    max_tokens: int | None,
) -> list[tuple[str | None, list[int]]]:
    """Every prompt tokenized (or its ids checked) in turn, each checked against the context
    (with `max_tokens` of output) and the request's token budget as soon as it is known, so
    a request that cannot fit stops at its first prompt that does not. Runs on the
    tokenizer thread (`ServerContext.off_loop`)."""
    processor, limits, max_len = ctx.engine.processor, ctx.limits, ctx.max_model_len
    out: list[tuple[str | None, list[int]]] = []
    num_tokens = 0
    for prompt in prompts:
        try:
            if isinstance(prompt, str):
                check_text(prompt, "prompt")
                ids = ctx.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                text: str | None = prompt
            else:
                text, ids = processor.tokenize_prompt(prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from e
        check_context(ctx, len(ids), max_tokens)
        num_tokens += len(ids)
        limits.check_request_tokens(num_tokens, max_len)
        out.append((text, ids))
    return out


def raise_if_error(c: CompletionOutput) -> None:
    """A choice that failed in the engine: 400 when its input was at fault, 503 when a retry
    may succeed, else 500 without the engine's words (they go to the log)."""
    if c.finish_reason != "error":
        return
    if c.error_kind == ERROR_INVALID:
        raise APIError(400, str(c.stop_reason))
    if c.error_kind == ERROR_BUSY:
        raise APIError(503, str(c.stop_reason), headers={"Retry-After": "1"})
    if c.error_kind == ERROR_DEAD:  # the front end's own words on which engine died
        raise APIError(500, f"The engine is dead: {c.stop_reason}")
    logger.error("a request failed in the engine: %s", c.stop_reason)
    raise APIError(500, "The request failed in the engine; the server's log has the details.")


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
