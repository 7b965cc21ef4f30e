"""Tool calling in chat completions: what `tools` and `tool_choice` make of a request.

| tool_choice          | the output is constrained to         | calls are read by            |
|----------------------|--------------------------------------|------------------------------|
| none                 | nothing                              | nobody: the text is content  |
| auto (with tools)    | nothing (or the user's constraint)   | the --tool-call-parser       |
| required             | `[{"name", "parameters"}, ...]`      | the JSON array itself        |
| {"function": {name}} | the function's parameters schema     | the text: it is arguments    |

Every mode renders the tools through the chat template's `tools` variable.

`auto` needs `--enable-auto-tool-choice` and `--tool-call-parser` (as in vLLM, else 400).
`required` and named choices use the structured-output JSON-schema path (xgrammar), so their
arguments are JSON that follows the schema. `finish_reason` is
`tool_calls` when `auto` or `required` produced calls and the model stopped; a named choice
finishes with `stop`, as OpenAI's API does. `parallel_tool_calls: false` allows one call.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field

from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from vserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStream
from vserve.entrypoints.openai.tool_parsers.base import StreamDelta
from vserve.entrypoints.openai.tool_parsers.json_calls import (
    FixedNameCall,
    JsonCallSequence,
    ToolCallDelta,
    ToolCallResult,
)
from vserve.entrypoints.openai.tool_settings import ToolSettings
from vserve.sampling_params import SamplingParams, StructuredOutputsParams

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}


# -- the plan for one request ---------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    mode: str = "none"  # none, auto, required, named
    tools: list[dict] | None = None  # for the chat template
    named: str | None = None
    parser: type[ToolCallStream] | None = None
    max_calls: int | None = None
    structured: StructuredOutputsParams | None = None
    keep_special_tokens: bool = False
    num_chars: int = 0  # of the tools' JSON (admission counts it)

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        changes = {}
        if self.structured is not None:
            changes["structured_outputs"] = self.structured
        if self.mode == "auto" and self.keep_special_tokens:
            changes["skip_special_tokens"] = False
        return params.clone(**changes) if changes else params

    def new_stream(self) -> ToolCallStream | None:
        if self.mode == "auto":
            return self.parser(self.max_calls)
        if self.mode == "required":
            return RequiredCallsStream(self.max_calls)
        if self.mode == "named":
            return NamedCallStream(self.named)
        return None

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(req: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    """Check `tools` and `tool_choice` (400 on bad input) and decide the mode."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "required" and req.tools == []:
        choice = "none"  # OpenAI's behaviour for an empty list
    if choice != "none" and req.tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    max_calls = None if req.parallel_tool_calls is not False else 1
    base = _template_fields(tools)
    base["max_calls"] = max_calls
    if choice == "none":
        return ToolPlan(**base)
    if choice == "auto":
        return _auto_plan(settings, base)
    if req.constrained:
        raise APIError(
            400,
            "tool_choice 'required' or a named function cannot be combined "
            "with response_format or structured outputs",
            "tool_choice",
        )
    if choice == "required":
        schema = required_schema(tools, max_calls)
        return ToolPlan(mode="required", structured=StructuredOutputsParams(json=schema), **base)
    return _named_plan(choice, tools, base)


def template_tools(tools: list[ChatCompletionTool] | None) -> ToolPlan:
    """Tools checked and rendered into the prompt, nothing else (`/tokenize`)."""
    return ToolPlan(**_template_fields(tools or []))


def _template_fields(tools: list[ChatCompletionTool]) -> dict:
    dicts = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    _check_unique(tools)
    return dict(tools=dicts or None, num_chars=sum(len(json.dumps(d)) for d in dicts))


def _auto_plan(settings: ToolSettings, base: dict) -> ToolPlan:
    if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise APIError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
            "tool_choice",
        )
    return ToolPlan(
        mode="auto",
        parser=TOOL_PARSERS[settings.tool_call_parser],
        keep_special_tokens=settings.keep_special_tokens,
        **base,
    )


def _named_plan(choice: NamedToolChoice, tools: list[ChatCompletionTool], base: dict) -> ToolPlan:
    name = choice.function.name
    found = [t for t in tools if t.function.name == name]
    if not found:
        raise APIError(
            400, f"tool_choice names the function {name!r}, which is not in `tools`", "tool_choice"
        )
    schema = found[0].function.parameters or _NO_PARAMETERS
    return ToolPlan(
        mode="named", named=name, structured=StructuredOutputsParams(json=schema), **base
    )


def _check_tool(i: int, tool: ChatCompletionTool) -> dict:
    fn = tool.function
    if not _NAME.match(fn.name):
        raise APIError(
            400,
            f"tools[{i}].function.name must be 1 to 64 letters, digits, "
            f"underscores or dashes, got {fn.name[:80]!r}",
            "tools",
        )
    params = fn.parameters
    if params is not None and params.get("type", "object") != "object":
        raise APIError(
            400,
            f"tools[{i}].function.parameters must be a JSON schema of type "
            f"object, got type {params.get('type')!r}",
            "tools",
        )
    for key, kind in (("properties", dict), ("required", list)):
        if params is not None and not isinstance(params.get(key, kind()), kind):
            raise APIError(
                400,
                f"tools[{i}].function.parameters.{key} must be a JSON "
                f"{'object' if kind is dict else 'array'}",
                "tools",
            )
    return tool.model_dump(exclude_none=True)


def _check_unique(tools: list[ChatCompletionTool]) -> None:
    seen = set()
    for tool in tools:
        if tool.function.name in seen:
            raise APIError(
                400, f"tools: the function name {tool.function.name!r} is given twice", "tools"
            )
        seen.add(tool.function.name)


def required_schema(tools: list[ChatCompletionTool], max_calls: int | None) -> dict:
    """A JSON array of one or more `{"name": <one of the tools>, "parameters": <its
    schema>}`; each tool's `$defs` move to the root, where its `$ref`s point."""
    items, defs = [], {}
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters) or dict(_NO_PARAMETERS)
        tool_defs = params.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise APIError(400, "tools: $defs must be a JSON object", "tools")
        for name, schema in tool_defs.items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(400, f"tools define $defs {name!r} differently", "tools")
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


# -- the output side --------------------------------------------------------------------------
class RequiredCallsStream(ToolCallStream):
    """`required`: the output is a JSON array of calls; nothing in it is content."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.sequence = JsonCallSequence(self.emitter)

    def _consume(self, text: str, final: bool) -> str:
        self.sequence.feed(text)
        return ""


class NamedCallStream(ToolCallStream):
    """A named function: the output is that function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.call = FixedNameCall(name)
        self.emitter.open(self.call)

    def _consume(self, text: str, final: bool) -> str:
        self.call.feed(text)
        return ""


@dataclass
class ChoiceTools:
    """One choice's parser and what it has found."""

    plan: ToolPlan
    stream: ToolCallStream = field(init=False)

    def __post_init__(self) -> None:
        self.stream = self.plan.new_stream()

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.stream.parse(text)
        return content, [_tool_call(c) for c in calls]

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        news = self.stream.feed(text)
        if finished:
            end = self.stream.finish()
            news = StreamDelta(news.content + end.content, news.tool_calls + end.tool_calls)
        calls = [_delta_call(d) for d in news.tool_calls]
        return news.content or None, calls or None

    @property
    def called(self) -> bool:
        return self.stream.emitter.num_named > 0


def _tool_call(call: ToolCallResult) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _delta_call(d: ToolCallDelta) -> DeltaToolCall:
    if d.name is None:
        return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
    return DeltaToolCall(
        index=d.index,
        id=d.id,
        type="function",
        function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
    )


# -- the conversation side --------------------------------------------------------------------
def message_tool_fields(m: ChatMessage) -> dict:
    """An assistant's calls and a tool result's id as the chat template sees them: the
    arguments as an object (what Hugging Face templates expect), not OpenAI's JSON text."""
    out = {}
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    return out


def _arguments(value: str | dict | None) -> dict:
    if isinstance(value, dict):
        return value
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except RecursionError:
        raise APIError(400, "a tool call's arguments are nested too deeply", "messages") from None
    except ValueError as e:
        raise APIError(400, f"a tool call's arguments are not valid JSON: {e}", "messages") from e
    if not isinstance(parsed, dict):
        raise APIError(400, "a tool call's arguments must be a JSON object", "messages")
    return parsed
