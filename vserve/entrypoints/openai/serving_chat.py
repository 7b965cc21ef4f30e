"""`POST /v1/chat/completions`: a conversation rendered with the chat template, to OpenAI chat
completions.

Content may be a string or a list of text parts (joined with newlines). Streaming sends, per
choice, a first event with `delta: {"role": "assistant", "content": ""}` when the first output
arrives, then content deltas, the last one carrying `finish_reason` (and vLLM's `stop_reason`);
then a usage-only event when asked, then `[DONE]`. With tools (`tool_calls.py`), a choice's
text goes through its tool-call parser: content deltas and `delta.tool_calls` come out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vserve.engine.output_processor import RequestState
from vserve.entrypoints.chat import render_chat
from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    usage_info,
)
from vserve.entrypoints.openai.reasoning import CLOSE, ReasoningStream, split
from vserve.entrypoints.openai.request_prep import (
    base_request_id,
    check_context,
    check_params,
    check_request,
    check_template_kwargs,
    conversation_chars,
    data_parallel_rank,
    make_sampling_params,
    prepare_constraint,
    raise_if_error,
    template_kwargs_chars,
)
from vserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    ServerContext,
    TokenStrings,
    iterate,
    release,
    sse_error,
    sse_event,
    submit,
    until_disconnect,
)
from vserve.entrypoints.openai.tool_calls import (
    ChoiceTools,
    ToolPlan,
    message_tool_fields,
    plan_tools,
)
from vserve.outputs import CompletionOutput, Logprob

_PROMPT_TAIL = 16  # prompt tokens read for a closed thought (thinking off writes one)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the template sees them: role, content as one string, optional name."""
    out = []
    for m in messages:
        entry = {"role": m.role, "content": m.text()}
        if m.name:
            entry["name"] = m.name
        entry.update(message_tool_fields(m))
        out.append(entry)
    return out


class ChatServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_str = TokenStrings(ctx.engine.tokenizer)

    async def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
        tools: ToolPlan | None = None,
    ) -> list[int]:
        """The conversation's characters checked (messages, tool calls, tools and template
        variables: the prompt's and the request's budgets), then the template rendered and
        the text encoded, all on the tokenizer thread."""
        return await self.ctx.off_loop(
            self._render,
            messages,
            add_generation_prompt,
            continue_final_message,
            kwargs or {},
            tools or ToolPlan(),
        )

    def _render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict,
        tools: ToolPlan,
    ) -> list[int]:
        ctx = self.ctx
        tokenizer = ctx.engine.tokenizer
        check_template_kwargs(kwargs, tokenizer)
        num_chars = conversation_chars(messages) + tools.num_chars + template_kwargs_chars(kwargs)
        ctx.limits.check_prompt_chars(num_chars, ctx.max_model_len, "messages")
        ctx.limits.check_request_chars(num_chars, ctx.max_model_len, "messages")
        try:
            return render_chat(
                tokenizer,
                conversation(messages),
                ctx.chat_template,
                add_generation_prompt,
                continue_final_message,
                kwargs,
                tools.tools,
            )
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e

    async def create(self, req: ChatCompletionRequest, raw: Request):
        ctx = self.ctx
        check_request(ctx, req, 1)
        tools = await asyncio.to_thread(plan_tools, req, ctx.tools)
        ids = await self.render(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            tools,
        )
        constraint = await prepare_constraint(
            ctx, lambda: tools.structured or req.structured_params(), await self._after(ids)
        )
        budget = check_context(ctx, len(ids), req.output_limit)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if logprobs is not None and not req.stream:
            ctx.limits.check_response_logprobs(req.n * budget * (logprobs + 1), "top_logprobs")
        params = tools.sampling_params(make_sampling_params(req, budget, logprobs, constraint))
        check_params(ctx, params, len(ids))
        base = base_request_id(raw)
        states = await submit(ctx, [(None, ids)], [params], base, data_parallel_rank(raw))
        response_id = f"chatcmpl-{base}"
        thinking = _reasoning_parser(ctx.reasoning_parser, params)
        if req.stream:
            return StreamingResponse(
                self._stream(req, response_id, len(ids), states, tools, thinking),
                media_type="text/event-stream",
            )
        try:
            body = await until_disconnect(
                raw, self._collect(req, response_id, len(ids), states, tools, thinking)
            )
        finally:
            release(ctx, states)
        return JSONResponse(body)

    async def _after(self, ids: list[int]) -> str | None:
        """What a structured-output constraint starts after: with a reasoning parser, the end
        of the thoughts, unless the prompt already closed them (thinking off) or the
        constraint covers the thoughts too (--structured-outputs-in-reasoning)."""
        ctx = self.ctx
        if ctx.reasoning_parser is None or ctx.structured_in_reasoning:
            return None
        tail = await ctx.off_loop(ctx.engine.tokenizer.decode, ids[-_PROMPT_TAIL:])
        return None if tail.rstrip().endswith(CLOSE) else CLOSE

    def _echo_text(self, req: ChatCompletionRequest) -> str:
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    # -- non-streaming -------------------------------------------------------------------------
    async def _collect(
        self,
        req: ChatCompletionRequest,
        response_id: str,
        num_prompt: int,
        states: list[RequestState],
        tools: ToolPlan,
        thinking: str | None,
    ) -> dict:
        texts = [self._echo_text(req)] * req.n
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
        finish: list[tuple[str | None, int | str | None]] = [(None, None)] * req.n
        num_out = cached = 0
        async for _, out in iterate(self.ctx, states):
            cached = max(cached, out.num_cached_tokens)
            for c in out.outputs:
                raise_if_error(c)
                texts[c.index] += c.text
                num_out += len(c.token_ids)
                logprobs[c.index] += self._logprobs(req, c)
                if c.finish_reason is not None:
                    finish[c.index] = (c.finish_reason, c.stop_reason)
        choices = []
        for i in range(req.n):
            message, reason = _message(tools, texts[i], finish[i][0], thinking)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=ChatLogprobs(content=logprobs[i]) if req.logprobs else None,
                    finish_reason=reason,
                    stop_reason=finish[i][1],
                )
            )
        return ChatCompletionResponse(
            id=response_id,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage_info(num_prompt, num_out, cached),
        ).model_dump()

    def _logprobs(self, req: ChatCompletionRequest, c: CompletionOutput) -> list[TokenLogprob]:
        if not req.logprobs:
            return []
        return [
            self._token_logprob(tid, entry, req.top_logprobs or 0)
            for tid, entry in zip(c.token_ids, c.logprobs or [])
        ]

    def _token_logprob(
        self, token_id: int, entry: dict[int, Logprob], num_top: int
    ) -> TokenLogprob:
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num_top]
        tops = [self._top(tid, lp.logprob) for tid, lp in ranked]
        sampled = self._top(token_id, entry[token_id].logprob)
        return TokenLogprob(**sampled.model_dump(), top_logprobs=tops)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_str(token_id)
        return TopLogprob(
            token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode("utf-8"))
        )

    # -- streaming -----------------------------------------------------------------------------
    async def _stream(
        self,
        req: ChatCompletionRequest,
        response_id: str,
        num_prompt: int,
        states: list[RequestState],
        tools: ToolPlan,
        thinking: str | None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.ctx.model_name

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(
                ChatCompletionChunk(
                    id=response_id, created=created, model=model, choices=choices, usage=usage
                )
            )

        num_out = cached = 0
        started = False
        echo = self._echo_text(req)
        pending_echo = dict.fromkeys(range(req.n), echo) if echo else {}
        parsers = {i: ChoiceTools(tools) for i in range(req.n)} if tools.parses else {}
        streams = {i: ReasoningStream(thinking) for i in range(req.n)} if thinking else {}
        try:
            async for _, out in iterate(self.ctx, states):
                cached = max(cached, out.num_cached_tokens)
                if not started:  # the role event, once per choice, with the first output
                    started = True
                    for i in range(req.n):
                        yield chunk(
                            [
                                ChatChunkChoice(
                                    index=i, delta=DeltaMessage(role="assistant", content="")
                                )
                            ]
                        )
                for c in out.outputs:
                    raise_if_error(c)
                    num_out += len(c.token_ids)
                    usage = (
                        usage_info(num_prompt, num_out, cached) if req.continuous_usage else None
                    )
                    logprobs = (
                        ChatLogprobs(content=self._logprobs(req, c)) if req.logprobs else None
                    )
                    text = pending_echo.pop(c.index, "") + c.text
                    thoughts = ""
                    if streams:  # the reasoning apart; what may begin a tag held back
                        done = c.finish_reason is not None
                        thoughts, text = streams[c.index].feed(text, final=done)
                    delta, reason = DeltaMessage(content=text), c.finish_reason
                    if parsers:
                        delta, reason = _tool_delta(parsers[c.index], text, reason)
                    elif streams and not text:
                        delta = None
                    if thoughts:
                        delta = (delta or DeltaMessage()).model_copy(
                            update={"reasoning_content": thoughts}
                        )
                    if (parsers or streams) and delta is None and reason is None:
                        if logprobs is None:
                            continue  # held back: it may be tool-call or tag markup
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=c.index,
                                delta=delta or DeltaMessage(),
                                logprobs=logprobs,
                                finish_reason=reason,
                                stop_reason=c.stop_reason,
                            )
                        ],
                        usage,
                    )
            if req.include_usage:
                yield chunk([], usage_info(num_prompt, num_out, cached))
        except Exception as e:  # noqa: BLE001 -- the status is sent; report in the stream
            yield sse_error(e)
        finally:
            release(self.ctx, states)
        yield SSE_DONE


def _reasoning_parser(parser: str | None, params) -> str | None:
    """The reasoning parser for a request: none for deepseek_r1 under a structured-output
    constraint (tool_choice required or named, response_format, guided_*) that applies from
    the first token (the prompt closed the thought, or --structured-outputs-in-reasoning):
    the implicit thought would never close and all would be reasoning."""
    constraint = params.structured_outputs
    if parser == "deepseek_r1" and constraint is not None and constraint.starts_after is None:
        return None
    return parser


def _message(
    tools: ToolPlan, text: str, reason: str | None, reasoning_parser: str | None
) -> tuple[ChatResponseMessage, str | None]:
    """A whole choice's message and finish reason: its reasoning apart (with a reasoning
    parser), then its tool calls parsed out of what remains."""
    thoughts = None
    if reasoning_parser is not None:
        parts = split(reasoning_parser, text)
        thoughts, text = parts.reasoning, parts.content or ""
    if not tools.parses:
        content = text if text or thoughts is None else None
        return ChatResponseMessage(content=content, reasoning_content=thoughts), reason
    parser = ChoiceTools(tools)
    content, calls = parser.whole(text)
    message = ChatResponseMessage(content=content, reasoning_content=thoughts, tool_calls=calls)
    return message, tools.finish_reason(reason, parser.called)


def _tool_delta(
    parser: ChoiceTools, text: str, reason: str | None
) -> tuple[DeltaMessage | None, str | None]:
    content, calls = parser.delta(text, reason is not None)
    delta = DeltaMessage(content=content, tool_calls=calls) if content or calls else None
    return delta, parser.plan.finish_reason(reason, parser.called)
