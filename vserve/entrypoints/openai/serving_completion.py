"""`POST /v1/completions`: prompts (text or token ids, one or a batch) to OpenAI completions.

A batch of P prompts with `n` choices each gives P*n choices, `index = prompt_idx * n + i`.
Non-streaming requests race the client's disconnect; streaming ones send one SSE event per
choice per engine step, then a usage-only event when asked, then `[DONE]`.

`echo` with `logprobs` returns the prompt's tokens first in the legacy logprobs (the first
token's logprob is None), computed by the engine as prompt logprobs; with `max_tokens=0` the
engine generates one token that is dropped (as vLLM does), so only the prompt comes back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from vserve.engine.output_processor import RequestState
from vserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    usage_info,
)
from vserve.entrypoints.openai.request_prep import (
    base_request_id,
    check_context,
    check_params,
    check_prompt_sizes,
    check_request,
    data_parallel_rank,
    make_sampling_params,
    prepare_constraint,
    prompt_list,
    raise_if_error,
    tokenize_all,
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
from vserve.outputs import CompletionOutput, Logprob

Prompt = tuple[str | None, list[int]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class _Choice:
    """One choice being accumulated (non-streaming) or tracked (streaming offsets)."""

    text: str = ""
    num_tokens: int = 0
    text_offset: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


@dataclass
class _PromptTables:
    """What every choice of one prompt shares when echoing or returning prompt logprobs,
    built once per prompt on the tokenizer thread (never per choice, never on the loop)."""

    text: str = ""  # the prompt's text (echo)
    head: CompletionLogprobs | None = None  # its tokens' legacy logprobs, offsets from 0
    head_chars: int = 0  # characters of its tokens: where a choice's own offsets start
    vllm: list[dict | None] | None = None  # vLLM's `prompt_logprobs` field


class CompletionServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_str = TokenStrings(ctx.engine.tokenizer)

    async def create(self, req: CompletionRequest, raw: Request):
        ctx = self.ctx
        given = prompt_list(req.prompt)
        check_request(ctx, req, len(given))
        check_prompt_sizes(ctx, given)
        prompt_lp, echo_only = req.engine_prompt_logprobs, _echo_without_generation(req)
        max_out = 1 if echo_only else req.max_tokens
        constraint = await prepare_constraint(ctx, req.structured_params)
        prompts = await ctx.off_loop(tokenize_all, ctx, given, req.add_special_tokens, max_out)
        budgets = [check_context(ctx, len(ids), max_out) for _, ids in prompts]
        ctx.limits.check_response_logprobs(_logprob_entries(req, prompts, budgets), "logprobs")
        if echo_only and prompt_lp is None:  # only the prompt back, no generation
            body = await ctx.off_loop(self._echo_only, req, prompts, base_request_id(raw))
            return Response(body, media_type="application/json")
        params = []
        for (_, ids), budget in zip(prompts, budgets):
            sp = make_sampling_params(req, budget, req.logprobs, constraint)
            if prompt_lp is not None:
                sp = sp.clone(prompt_logprobs=prompt_lp)
            check_params(ctx, sp, len(ids))
            params.append(sp)
        base = base_request_id(raw)
        states = await submit(ctx, prompts, params, base, data_parallel_rank(raw))
        response_id = f"cmpl-{base}"
        if req.stream:
            return StreamingResponse(
                self._stream(req, response_id, prompts, states), media_type="text/event-stream"
            )
        try:
            body = await until_disconnect(raw, self._collect(req, response_id, prompts, states))
        finally:
            release(ctx, states)
        return Response(body, media_type="application/json")

    def _tables(
        self, req: CompletionRequest, prompt: Prompt, entries: PromptLogprobs | None
    ) -> _PromptTables:
        text, ids = prompt
        tables = _PromptTables()
        if req.echo:
            tables.text = text if text is not None else self.ctx.engine.tokenizer.decode(ids)
            if req.logprobs is not None:
                tables.head = self._logprobs(_Choice(), ids, entries, req.logprobs)
                tables.head_chars = sum(len(t) for t in tables.head.tokens)
        tables.vllm = self._vllm_prompt_logprobs(req, prompt, entries)
        return tables

    # -- non-streaming -------------------------------------------------------------------------
    async def _collect(
        self,
        req: CompletionRequest,
        response_id: str,
        prompts: list[Prompt],
        states: list[RequestState],
    ) -> bytes:
        choices = [_Choice() for _ in range(len(prompts) * req.n)]
        prompt_lps: list[PromptLogprobs | None] = [None] * len(prompts)
        cached = [0] * len(prompts)
        async for prompt_idx, out in iterate(self.ctx, states):
            prompt_lps[prompt_idx] = out.prompt_logprobs or prompt_lps[prompt_idx]
            cached[prompt_idx] = max(cached[prompt_idx], out.num_cached_tokens)
            for c in out.outputs:
                self._accumulate(choices[prompt_idx * req.n + c.index], c, req)
        return await self.ctx.off_loop(
            self._response, req, response_id, prompts, prompt_lps, choices, sum(cached)
        )

    def _response(
        self,
        req: CompletionRequest,
        response_id: str,
        prompts: list[Prompt],
        prompt_lps: list[PromptLogprobs | None],
        choices: list[_Choice],
        cached: int,
    ) -> bytes:
        """The whole body, prompt tables built once per prompt, encoded (the tokenizer
        thread: its size grows with the prompts and n)."""
        tables = [self._tables(req, p, lps) for p, lps in zip(prompts, prompt_lps)]
        if req.echo:
            for i, choice in enumerate(choices):
                self._echo(choice, req, tables[i // req.n])
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_out = sum(c.num_tokens for c in choices)
        return _encode(
            CompletionResponse(
                id=response_id,
                model=self.ctx.model_name,
                choices=[
                    CompletionChoice.model_construct(
                        index=i,
                        text=c.text,
                        logprobs=c.logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=tables[i // req.n].vllm,
                    )
                    for i, c in enumerate(choices)
                ],
                usage=usage_info(num_prompt, num_out, cached),
            )
        )

    def _accumulate(self, choice: _Choice, c: CompletionOutput, req: CompletionRequest) -> None:
        raise_if_error(c)
        if c.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        if _echo_without_generation(req):
            return  # (the one token generated for the prompt's logprobs is not returned)
        choice.text += c.text
        choice.num_tokens += len(c.token_ids)
        if req.logprobs is not None:
            delta = self._logprobs(choice, c.token_ids, c.logprobs)
            if choice.logprobs is None:
                choice.logprobs = delta
            else:
                _extend(choice.logprobs, delta)

    def _echo(self, choice: _Choice, req: CompletionRequest, tables: _PromptTables) -> None:
        """The prompt in front of a finished choice: its text, and its tokens' logprobs in
        front of the generated ones (whose text offsets move by the prompt's length)."""
        choice.text = tables.text + choice.text
        if req.logprobs is None or tables.head is None:
            return
        tail = choice.logprobs or CompletionLogprobs()
        choice.logprobs = _shifted(tables.head, tail, tables.head_chars)

    def _logprobs(
        self,
        choice: _Choice,
        token_ids: list[int],
        entries: PromptLogprobs | None,
        limit: int | None = None,
    ) -> CompletionLogprobs:
        """Legacy logprobs of `token_ids`; `limit` keeps the top-`limit` of each entry
        besides the token's own (prompt entries may hold more)."""
        out = CompletionLogprobs()
        for tid, entry in zip(token_ids, entries or []):
            token = self.token_str(tid)
            out.text_offset.append(choice.text_offset)
            out.tokens.append(token)
            choice.text_offset += len(token)
            if entry is None:  # the prompt's first token
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry[tid].logprob if tid in entry else None)
            top: dict[str, float] = {}  # tokens that decode alike keep the highest logprob
            for t, lp in sorted(entry.items(), key=lambda item: -item[1].logprob):
                if limit is None or t == tid or lp.rank <= limit:
                    top.setdefault(self.token_str(t), lp.logprob)
            out.top_logprobs.append(top)
        return out

    def _vllm_prompt_logprobs(
        self, req: CompletionRequest, prompt: Prompt, entries: PromptLogprobs | None
    ) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` field of a choice: token ids (as strings) -> logprob,
        rank and decoded text; the prompt token's own entry and the top `prompt_logprobs`."""
        if req.prompt_logprobs is None or entries is None:
            return None
        limit = req.prompt_logprobs
        return [
            None
            if e is None
            else {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_str(t)}
                for t, lp in e.items()
                if t == tid or lp.rank <= limit
            }
            for tid, e in zip(prompt[1], entries)
        ]

    def _echo_only(self, req: CompletionRequest, prompts: list[Prompt], base: str) -> bytes:
        """Each prompt decoded once, whatever `n` (the tokenizer thread)."""
        texts = [
            text if text is not None else self.ctx.engine.tokenizer.decode(ids)
            for text, ids in prompts
        ]
        choices = [
            CompletionChoice(index=i, text=texts[i // req.n], finish_reason="length")
            for i in range(len(prompts) * req.n)
        ]
        num_prompt = sum(len(ids) for _, ids in prompts)
        return _encode(
            CompletionResponse(
                id=f"cmpl-{base}",
                model=self.ctx.model_name,
                choices=choices,
                usage=usage_info(num_prompt, 0, 0),  # no engine request: nothing cached
            )
        )

    # -- streaming -----------------------------------------------------------------------------
    async def _stream(
        self,
        req: CompletionRequest,
        response_id: str,
        prompts: list[Prompt],
        states: list[RequestState],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        choices = [_Choice() for _ in range(len(prompts) * req.n)]
        num_prompt = sum(len(ids) for _, ids in prompts)
        prompt_lps: list[PromptLogprobs | None] = [None] * len(prompts)
        tables: list[_PromptTables | None] = [None] * len(prompts)
        shares = req.echo or req.prompt_logprobs is not None
        cached = [0] * len(prompts)
        try:
            async for prompt_idx, out in iterate(self.ctx, states):
                prompt_lps[prompt_idx] = out.prompt_logprobs or prompt_lps[prompt_idx]
                cached[prompt_idx] = max(cached[prompt_idx], out.num_cached_tokens)
                if shares and tables[prompt_idx] is None:
                    tables[prompt_idx] = await self.ctx.off_loop(
                        self._tables, req, prompts[prompt_idx], prompt_lps[prompt_idx]
                    )
                for c in out.outputs:
                    raise_if_error(c)
                    index = prompt_idx * req.n + c.index
                    chunk = self._chunk(
                        req, response_id, created, index, choices[index], c, tables[prompt_idx]
                    )
                    if req.continuous_usage:
                        chunk.usage = _usage(num_prompt, choices, sum(cached))
                    yield sse_event(chunk)
            if req.include_usage:
                yield sse_event(
                    CompletionChunk(
                        id=response_id,
                        created=created,
                        model=self.ctx.model_name,
                        choices=[],
                        usage=_usage(num_prompt, choices, sum(cached)),
                    )
                )
        except Exception as e:  # noqa: BLE001 -- the status is sent; report in the stream
            yield sse_error(e)
        finally:
            release(self.ctx, states)
        yield SSE_DONE

    def _chunk(
        self,
        req: CompletionRequest,
        response_id: str,
        created: int,
        index: int,
        choice: _Choice,
        c: CompletionOutput,
        tables: _PromptTables | None,
    ) -> CompletionChunk:
        """A choice's next event; its first one starts with the prompt when echoing."""
        first, choice.started = not choice.started, True
        text, token_ids, entries = (
            ("", [], None) if _echo_without_generation(req) else (c.text, c.token_ids, c.logprobs)
        )
        choice.num_tokens += len(token_ids)
        echo = req.echo and first and tables is not None
        if echo:
            text = tables.text + text
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo and tables.head is not None:
                logprobs = _shifted(tables.head, logprobs, 0)
                choice.text_offset += tables.head_chars
            _extend(logprobs, self._logprobs(choice, token_ids, entries))
        return CompletionChunk(
            id=response_id,
            created=created,
            model=self.ctx.model_name,
            choices=[
                CompletionChoice.model_construct(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=tables.vllm if first and tables is not None else None,
                )
            ],
        )


def _logprob_entries(req: CompletionRequest, prompts: list[Prompt], budgets: list[int]) -> int:
    """Logprob entries the response would carry: per choice, the prompt's (echo, vLLM's
    prompt_logprobs) and, when not streamed, the generated tokens' (top-k + 1 each)."""
    total = 0
    for (_, ids), budget in zip(prompts, budgets):
        if req.echo and req.logprobs is not None:
            total += len(ids) * (req.logprobs + 1)
        if req.prompt_logprobs is not None:
            total += len(ids) * (req.prompt_logprobs + 1)
        if req.logprobs is not None and not req.stream and not _echo_without_generation(req):
            total += budget * (req.logprobs + 1)
    return total * req.n


def _usage(num_prompt: int, choices: list[_Choice], cached: int) -> UsageInfo:
    return usage_info(num_prompt, sum(c.num_tokens for c in choices), cached)


def _echo_without_generation(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens=0`: the prompt (and its logprobs) back, nothing generated."""
    return req.echo and req.max_tokens == 0


def _extend(into: CompletionLogprobs, more: CompletionLogprobs) -> CompletionLogprobs:
    for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        getattr(into, name).extend(getattr(more, name))
    return into


def _shifted(head: CompletionLogprobs, tail: CompletionLogprobs, shift: int) -> CompletionLogprobs:
    """`head` (shared by a prompt's choices, never changed) then `tail` moved by `shift`."""
    return CompletionLogprobs.model_construct(
        text_offset=head.text_offset + [o + shift for o in tail.text_offset],
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        tokens=head.tokens + tail.tokens,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
    )


def _encode(model: BaseModel) -> bytes:
    """A response model as JSON, by pydantic's serializer (no intermediate dicts)."""
    return model.model_dump_json().encode()
