"""`POST /v1/completions`: prompts (text or token ids, one or a batch) to OpenAI completions.

A batch of P prompts with `n` choices each gives P*n choices, `index = prompt_idx * n + i`.
Non-streaming requests race the client's disconnect; streaming ones send one SSE event per
choice per engine step, then a usage-only event when asked, then `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vserve.engine.output_processor import RequestState
from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from vserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    ServerContext,
    TokenStrings,
    base_request_id,
    check_context,
    check_params,
    check_request,
    iterate,
    make_sampling_params,
    release,
    sse_error,
    sse_event,
    submit,
    tokenize,
    until_disconnect,
)
from vserve.outputs import CompletionOutput, Logprob

Prompt = tuple[str | None, list[int]]


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


class CompletionServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_str = TokenStrings(ctx.engine.tokenizer)

    async def create(self, req: CompletionRequest, raw: Request):
        ctx = self.ctx
        check_request(ctx, req, _num_prompts(req.prompt))
        prompts = await self._prompts(req)
        if req.echo and req.max_tokens == 0:   # only the prompt back, no generation
            return JSONResponse(self._echo_only(req, prompts, base_request_id(raw)))
        params = []
        for _, ids in prompts:
            budget = check_context(ctx, len(ids), req.max_tokens)
            sp = make_sampling_params(req, budget, req.logprobs)
            await check_params(ctx, sp, len(ids))
            params.append(sp)
        base = base_request_id(raw)
        states = await submit(ctx, prompts, params, base)
        response_id = f"cmpl-{base}"
        if req.stream:
            return StreamingResponse(self._stream(req, response_id, prompts, states),
                                     media_type="text/event-stream")
        try:
            body = await until_disconnect(raw, self._collect(req, response_id, prompts, states))
        finally:
            release(ctx, states)
        return JSONResponse(body)

    async def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return [await tokenize(self.ctx, p, req.add_special_tokens) for p in prompt]
        return [await tokenize(self.ctx, prompt, req.add_special_tokens)]

    def _prompt_text(self, prompt: Prompt) -> str:
        text, ids = prompt
        return text if text is not None else self.ctx.engine.tokenizer.decode(ids)

    # -- non-streaming -------------------------------------------------------------------------
    async def _collect(self, req: CompletionRequest, response_id: str, prompts: list[Prompt],
                       states: list[RequestState]) -> dict:
        choices = [_Choice() for _ in range(len(prompts) * req.n)]
        async for prompt_idx, out in iterate(self.ctx, states):
            for c in out.outputs:
                self._accumulate(choices[prompt_idx * req.n + c.index], c, req)
        if req.echo:
            for i, choice in enumerate(choices):
                choice.text = self._prompt_text(prompts[i // req.n]) + choice.text
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_out = sum(c.num_tokens for c in choices)
        return CompletionResponse(
            id=response_id, model=self.ctx.model_name,
            choices=[CompletionChoice(index=i, text=c.text, logprobs=c.logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for i, c in enumerate(choices)],
            usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_out,
                            total_tokens=num_prompt + num_out)).model_dump()

    def _accumulate(self, choice: _Choice, c: CompletionOutput, req: CompletionRequest) -> None:
        _raise_if_error(c)
        choice.text += c.text
        choice.num_tokens += len(c.token_ids)
        if req.logprobs is not None:
            delta = self._logprobs(choice, c.token_ids, c.logprobs)
            if choice.logprobs is None:
                choice.logprobs = delta
            else:
                for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(choice.logprobs, name).extend(getattr(delta, name))
        if c.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

    def _logprobs(self, choice: _Choice, token_ids: list[int],
                  entries: list[dict[int, Logprob]] | None) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for tid, entry in zip(token_ids, entries or []):
            token = self.token_str(tid)
            out.text_offset.append(choice.text_offset)
            out.tokens.append(token)
            out.token_logprobs.append(entry[tid].logprob if tid in entry else None)
            out.top_logprobs.append({self.token_str(t): lp.logprob for t, lp in entry.items()})
            choice.text_offset += len(token)
        return out

    def _echo_only(self, req: CompletionRequest, prompts: list[Prompt], base: str) -> dict:
        choices = [CompletionChoice(index=i, text=self._prompt_text(prompts[i // req.n]),
                                    finish_reason="length")
                   for i in range(len(prompts) * req.n)]
        num_prompt = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(id=f"cmpl-{base}", model=self.ctx.model_name,
                                  choices=choices,
                                  usage=UsageInfo(prompt_tokens=num_prompt,
                                                  total_tokens=num_prompt)).model_dump()

    # -- streaming -----------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, response_id: str, prompts: list[Prompt],
                      states: list[RequestState]) -> AsyncIterator[str]:
        created = int(time.time())
        choices = [_Choice() for _ in range(len(prompts) * req.n)]
        num_prompt = sum(len(ids) for _, ids in prompts)
        try:
            async for prompt_idx, out in iterate(self.ctx, states):
                for c in out.outputs:
                    _raise_if_error(c)
                    index = prompt_idx * req.n + c.index
                    yield sse_event(self._chunk(req, response_id, created, index,
                                                choices[index], c, prompts[prompt_idx],
                                                num_prompt, choices))
            if req.include_usage:
                yield sse_event(CompletionChunk(id=response_id, created=created,
                                                model=self.ctx.model_name, choices=[],
                                                usage=_usage(num_prompt, choices)))
        except Exception as e:  # noqa: BLE001 -- the status is sent; report in the stream
            yield sse_error(e)
        finally:
            release(self.ctx, states)
        yield SSE_DONE

    def _chunk(self, req: CompletionRequest, response_id: str, created: int, index: int,
               choice: _Choice, c: CompletionOutput, prompt: Prompt, num_prompt: int,
               choices: list[_Choice]) -> CompletionChunk:
        text = c.text
        if req.echo and not choice.started:
            text = self._prompt_text(prompt) + text
        choice.started = True
        choice.num_tokens += len(c.token_ids)
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._logprobs(choice, c.token_ids, c.logprobs)
        chunk = CompletionChunk(
            id=response_id, created=created, model=self.ctx.model_name,
            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason)])
        if req.continuous_usage:
            chunk.usage = _usage(num_prompt, choices)
        return chunk


def _num_prompts(prompt: str | list) -> int:
    """A batch is a list of strings or of token-id lists; a string or one id list is one."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _usage(num_prompt: int, choices: list[_Choice]) -> UsageInfo:
    num_out = sum(c.num_tokens for c in choices)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_out,
                     total_tokens=num_prompt + num_out)


def _raise_if_error(c: CompletionOutput) -> None:
    if c.finish_reason == "error":
        raise APIError(500, f"The request failed in the engine: {c.stop_reason}")
