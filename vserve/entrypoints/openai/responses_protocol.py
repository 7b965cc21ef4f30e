"""The Responses API's request and objects (`POST /v1/responses`), and their mapping onto a
chat completion: a Responses request becomes the chat request it means (instructions as the
system message, input items as messages, function tools, `text.format` as `response_format`,
the chat endpoint's extra fields as they are),
so every check, limit, tool parser, reasoning parser and structured-output path of the chat
endpoint serves it; the chat result becomes the Response object and its output items.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import ValidationError

from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None  # refused when true: every response is made while asked
    # the chat endpoint's extras (vLLM's), passed to it as they are (CHAT_EXTRAS)
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    ignore_eos: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    chat_template_kwargs: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


CHAT_EXTRAS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "chat_template_kwargs",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# -- request -> chat ---------------------------------------------------------------------------
def chat_request(req: ResponsesRequest, turn: list[dict]) -> ChatCompletionRequest:
    """The chat request a Responses request means; `turn` the conversation's messages: the
    earlier turns' (previous_response_id) and this request's input (`input_messages`)."""
    if req.background:
        raise APIError(400, "background responses are not supported", "background")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += turn
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for key, value in (
        ("model", req.model),
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("user", req.user),
    ):
        if value is not None:
            body[key] = value
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", "text")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") != "text":
        raise APIError(400, f"text.format type {str(fmt.get('type'))[:40]!r} is not supported")
    extras = {k: getattr(req, k) for k in CHAT_EXTRAS if getattr(req, k) is not None}
    try:
        return ChatCompletionRequest.model_validate({**body, **extras})
    except ValidationError as e:
        raise APIError(400, str(e.errors()[:3])) from None


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Input items as chat messages: messages (input_text parts joined), function calls
    (consecutive ones in one assistant message) and their outputs; reasoning items dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output)
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": content}
            )
        elif kind != "reasoning":
            raise APIError(400, f"input item type {str(kind)[:40]!r} is not supported", "input")
    return messages


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "a message's content must be a string or a list of parts", "input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"content part type {str(kind)[:40]!r} is not supported", "input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _chat_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tool type {str(tool.get('type'))[:40]!r} is not supported", "tools")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# -- chat -> response --------------------------------------------------------------------------
def response_object(
    req: ResponsesRequest,
    response_id: str,
    created: int,
    model: str,
    output: list[dict],
    status: str,
    usage: dict | None,
) -> dict:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "usage": usage,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "text": req.text or {"format": {"type": "text"}},
        "store": req.store,
        "metadata": req.metadata or {},
        "error": None,
        "incomplete_details": incomplete,
    }


def response_usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else [output_text(text)],
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status="completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict) -> list[dict]:
    """A chat choice's message as Responses output items: its reasoning, its text, its calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"]))
    return items


def history_messages(output: list[dict]) -> list[dict]:
    """A response's output as the chat messages a later turn continues from."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
