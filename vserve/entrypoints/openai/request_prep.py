"""Preparing a request, before it reaches the engine: what the parsed body alone decides
(model name, fan-out, stops, biases, the prompts' sizes against the character and token
budgets), tokenization on the tokenizer thread with each prompt checked against the context
as soon as it is encoded, the structured-output constraint made and checked once, sampling
parameters, the characters of a conversation and the template variables it may set, and
how an engine failure reads to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import msgspec
from fastapi import Request

from vserve.core.outputs import ERROR_BUSY, ERROR_DEAD, ERROR_INVALID
from vserve.engine.processor import check_text
from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.protocol import ChatMessage, SamplingRequest, random_id
from vserve.entrypoints.openai.serving_base import ServerContext
from vserve.outputs import CompletionOutput
from vserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("vserve.server")


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
    ctx: ServerContext,
    make: Callable[[], StructuredOutputsParams | None],
    starts_after: str | None = None,
) -> StructuredOutputsParams | None:
    """A request's structured-output constraint, made and checked once (its size against
    --max-constraint-chars, then that it parses) on a worker thread: its text may be long.
    `starts_after`: the text it waits for (a thinking model's end of thoughts)."""

    def prepare() -> StructuredOutputsParams | None:
        try:
            constraint = make()
            if constraint is not None and starts_after is not None:
                constraint = msgspec.structs.replace(constraint, starts_after=starts_after)
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


def prompt_list(prompt: str | list) -> list:
    """A batch is a list of strings or of token-id lists; a string or one id list is one."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


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


# template variables a request may not set: the tokenizer's special tokens (which
# transformers passes in) and what the server passes itself
_RESERVED_TEMPLATE_VARS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
        "raise_exception",
    }
)


def check_template_kwargs(kwargs: dict, tokenizer) -> None:
    """400 for a chat_template_kwargs key that would replace a special token (`bos_token`)
    or a variable the server sets."""
    special = set(getattr(tokenizer, "special_tokens_map", None) or {})
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_VARS or key in special:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {key[:40]!r}: it is the tokenizer's or the "
                "server's own",
                "chat_template_kwargs",
            )


def template_kwargs_chars(kwargs: dict) -> int:
    """Characters the template variables add (their JSON: what a template can print)."""
    if not kwargs:
        return 0
    try:
        return len(json.dumps(kwargs))
    except (TypeError, ValueError, RecursionError):
        raise APIError(
            400, "chat_template_kwargs must be plain JSON", "chat_template_kwargs"
        ) from None


def conversation_chars(messages: list[ChatMessage]) -> int:
    """Characters of a conversation as the template may print them: roles, contents, names,
    tool-call ids, names and arguments."""
    total = 0
    for m in messages:
        total += len(m.role) + len(m.text()) + len(m.name or "") + len(m.tool_call_id or "")
        for call in m.tool_calls or []:
            arguments = call.function.arguments
            total += len(call.id or "") + len(call.function.name)
            total += (
                len(arguments)
                if isinstance(arguments, str)
                else template_kwargs_chars(arguments or {})
            )
    return total
