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
    data_parallel_rank,
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


class CompletionServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_str = TokenStrings(ctx.engine.tokenizer)

    async def create(self, req: CompletionRequest, raw: Request):
        ctx = self.ctx
        check_request(ctx, req, _num_prompts(req.prompt))
        prompts = await self._prompts(req)
        prompt_lp, echo_only = req.engine_prompt_logprobs, _echo_without_generation(req)
        if echo_only and prompt_lp is None:  # only the prompt back, no generation
            return JSONResponse(self._echo_only(req, prompts, base_request_id(raw)))
        params = []
        for _, ids in prompts:
            budget = check_context(ctx, len(ids), 1 if echo_only else req.max_tokens)
            sp = make_sampling_params(req, budget, req.logprobs)
            if prompt_lp is not None:
                sp = sp.clone(prompt_logprobs=prompt_lp)
            await check_params(ctx, sp, len(ids))
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
    async def _collect(
        self,
        req: CompletionRequest,
        response_id: str,
        prompts: list[Prompt],
        states: list[RequestState],
    ) -> dict:
        choices = [_Choice() for _ in range(len(prompts) * req.n)]
        prompt_lps: list[PromptLogprobs | None] = [None] * len(prompts)
        async for prompt_idx, out in iterate(self.ctx, states):
            prompt_lps[prompt_idx] = out.prompt_logprobs or prompt_lps[prompt_idx]
            for c in out.outputs:
                self._accumulate(choices[prompt_idx * req.n + c.index], c, req)
        if req.echo:
            for i, choice in enumerate(choices):
                self._echo(choice, req, prompts[i // req.n], prompt_lps[i // req.n])
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_out = sum(c.num_tokens for c in choices)
        return CompletionResponse(
            id=response_id,
            model=self.ctx.model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.text,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self._vllm_prompt_logprobs(
                        req, prompts[i // req.n], prompt_lps[i // req.n]
                    ),
                )
                for i, c in enumerate(choices)
            ],
            usage=UsageInfo(
                prompt_tokens=num_prompt,
                completion_tokens=num_out,
                total_tokens=num_prompt + num_out,
            ),
        ).model_dump()

    def _accumulate(self, choice: _Choice, c: CompletionOutput, req: CompletionRequest) -> None:
        _raise_if_error(c)
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

    def _echo(
        self,
        choice: _Choice,
        req: CompletionRequest,
        prompt: Prompt,
        prompt_lps: PromptLogprobs | None,
    ) -> None:
        """The prompt in front of a finished choice: its text, and its tokens' logprobs in
        front of the generated ones (whose text offsets move by the prompt's length)."""
        choice.text = self._prompt_text(prompt) + choice.text
        if req.logprobs is None:
            return
        head = self._logprobs(_Choice(), prompt[1], prompt_lps, req.logprobs)
        shift = sum(len(t) for t in head.tokens)
        tail = choice.logprobs or CompletionLogprobs()
        tail.text_offset = [o + shift for o in tail.text_offset]
        choice.logprobs = _extend(head, tail)

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

    def _echo_only(self, req: CompletionRequest, prompts: list[Prompt], base: str) -> dict:
        choices = [
            CompletionChoice(
                index=i, text=self._prompt_text(prompts[i // req.n]), finish_reason="length"
            )
            for i in range(len(prompts) * req.n)
        ]
        num_prompt = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(
            id=f"cmpl-{base}",
            model=self.ctx.model_name,
            choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, total_tokens=num_prompt),
        ).model_dump()

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
        try:
            async for prompt_idx, out in iterate(self.ctx, states):
                prompt_lps[prompt_idx] = out.prompt_logprobs or prompt_lps[prompt_idx]
                for c in out.outputs:
                    _raise_if_error(c)
                    index = prompt_idx * req.n + c.index
                    yield sse_event(
                        self._chunk(
                            req,
                            response_id,
                            created,
                            index,
                            choices[index],
                            c,
                            prompts[prompt_idx],
                            prompt_lps[prompt_idx],
                            num_prompt,
                            choices,
                        )
                    )
            if req.include_usage:
                yield sse_event(
                    CompletionChunk(
                        id=response_id,
                        created=created,
                        model=self.ctx.model_name,
                        choices=[],
                        usage=_usage(num_prompt, choices),
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
        prompt: Prompt,
        prompt_lps: PromptLogprobs | None,
        num_prompt: int,
        choices: list[_Choice],
    ) -> CompletionChunk:
        """A choice's next event; its first one starts with the prompt when echoing."""
        first, choice.started = not choice.started, True
        text, token_ids, entries = (
            ("", [], None) if _echo_without_generation(req) else (c.text, c.token_ids, c.logprobs)
        )
        choice.num_tokens += len(token_ids)
        echo = req.echo and first
        if echo:
            text = self._prompt_text(prompt) + text
        logprobs = None
        if req.logprobs is not None:
            logprobs = (
                self._logprobs(choice, prompt[1], prompt_lps, req.logprobs)
                if echo
                else CompletionLogprobs()
            )
            _extend(logprobs, self._logprobs(choice, token_ids, entries))
        chunk = CompletionChunk(
            id=response_id,
            created=created,
            model=self.ctx.model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self._vllm_prompt_logprobs(req, prompt, prompt_lps)
                    if first
                    else None,
                )
            ],
        )
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
    return UsageInfo(
        prompt_tokens=num_prompt, completion_tokens=num_out, total_tokens=num_prompt + num_out
    )


def _echo_without_generation(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens=0`: the prompt (and its logprobs) back, nothing generated."""
    return req.echo and req.max_tokens == 0


def _extend(into: CompletionLogprobs, more: CompletionLogprobs) -> CompletionLogprobs:
    for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        getattr(into, name).extend(getattr(more, name))
    return into


def _raise_if_error(c: CompletionOutput) -> None:
    if c.finish_reason == "error":
        raise APIError(500, f"The request failed in the engine: {c.stop_reason}")
