"""Pydantic models of the OpenAI-compatible HTTP API: requests, responses, stream chunks, errors.

Requests allow unknown fields (as vLLM does: clients send `user` and provider-specific
extras), and the server logs the ones it ignores. Shapes follow the OpenAI API plus vLLM's
extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`stop_reason`, ...). Range checks of sampling values live in `SamplingParams`; here only what
the wire format itself constrains.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    field_serializer,
    model_validator,
)

from vserve.sampling_params import StructuredOutputsParams

MAX_N = 128  # most choices per request (vLLM has no limit; we refuse fan-out bombs)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs

TokenId = Annotated[int, Field(ge=0)]


def random_id() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# -- requests ----------------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class StructuredOutputsRequest(BaseModel):
    """`structured_outputs`: exactly one constraint (checked by StructuredOutputsParams).
    Unknown keys are an error: a constraint that is silently dropped is worse than a 400."""

    model_config = ConfigDict(extra="forbid")

    # `json` on the wire; the attribute name would shadow BaseModel.json
    json_schema: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, by_alias=True)


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(OpenAIBaseModel):
    """Fields that completions and chat share (sampling, stopping, streaming)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @model_validator(mode="after")
    def _check_shared(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        return self

    def structured_params(self) -> StructuredOutputsParams | None:
        """response_format, structured_outputs or the legacy guided_* fields, as one
        StructuredOutputsParams; more than one kind of constraint is an error."""
        found = []
        kind = self.response_format.type if self.response_format else "text"
        if kind == "json_object":
            found.append({"json_object": True})
        elif kind == "json_schema":
            fmt = self.response_format.json_schema
            if fmt is None or fmt.json_schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            found.append({"json": fmt.json_schema})
        if self.structured_outputs is not None:
            found.append(self.structured_outputs.as_dict())
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append({name: value})
        if not found:
            return None
        if len(found) > 1:
            raise ValueError("only one kind of structured output constraint per request")
        return StructuredOutputsParams(**found[0])

    @property
    def constrained(self) -> bool:
        """Whether any structured-output field is given (valid or not)."""
        kind = self.response_format.type if self.response_format else "text"
        guided = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        given = (self.structured_outputs, *guided)
        return kind != "text" or any(value is not None for value in given)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM: top-k per prompt token, on each choice
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal to n)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value}")
        return self

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: vLLM's extra parameter, else `logprobs` with echo."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


# -- tools (requests; the checks that need the server's settings are in tool_calls.py) ------
class FunctionDefinition(OpenAIBaseModel):
    name: StrictStr
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: StrictStr


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] | None = None  # JSON text (OpenAI) or an object


class ToolCallParam(OpenAIBaseModel):
    """A call in an assistant message sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
                )
        if self.chat_template is not None:
            raise ValueError(
                "a chat template in the request is not trusted; start the "
                "server with --chat-template instead"
            )
        return self

    @property
    def output_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


# -- responses ---------------------------------------------------------------------------------
class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # OpenAI's shape: the prompt tokens the prefix cache served (vLLM sends it with
    # --enable-prompt-tokens-details, null otherwise)
    prompt_tokens_details: PromptTokenUsageInfo | None = None


def usage_info(num_prompt: int, num_out: int, cached: int) -> UsageInfo:
    """A response's usage: `cached` of the `num_prompt` prompt tokens came from the prefix
    cache (RequestOutput.num_cached_tokens, summed over the prompts)."""
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_out,
        total_tokens=num_prompt + num_out,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached),
    )


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM: per prompt token, None for the first, else {token id: {logprob, rank,
    # decoded_token}}; only when `prompt_logprobs` was asked
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call: the first delta of a call has id, type and name, later ones carry
    argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's: the thoughts (--reasoning-parser)
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # OpenAI omits unset delta fields


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
