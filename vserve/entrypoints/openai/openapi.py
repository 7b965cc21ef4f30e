"""The OpenAPI document (`/openapi.json`, shown by `/docs`) describes every request body and
response, so that generic clients, SDK generators and fuzzers (schemathesis) can drive the API.

The handlers parse their bodies themselves (`errors.parse_body`: OpenAI-style 400s, NaN
refused, depth-limited), so FastAPI does not see the body models; each POST route declares
its models with `body_doc(Request, Response, Chunk)`, and `document_bodies` adds the models'
JSON schemas to the document's components, with a description on every field that the OpenAI
API does not have (vLLM's extras, `FIELD_DOCS`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from vserve.entrypoints.openai.protocol import MAX_N, MAX_TOP_LOGPROBS, ErrorResponse

_REF = "#/components/schemas/{model}"

# fields of the request bodies that the OpenAI API reference has (completions, chat,
# responses and embeddings)
OPENAI_FIELDS = frozenset(
    {
        "model",
        "input",
        "encoding_format",
        "dimensions",
        "instructions",
        "max_output_tokens",
        "previous_response_id",
        "background",
        "prompt",
        "messages",
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "include_usage",
        "suffix",
        "temperature",
        "top_p",
        "user",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "metadata",
        "store",
        "service_tier",
        "reasoning_effort",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "role",
        "content",
        "name",
        "type",
        "text",
        "tool_calls",
        "tool_call_id",
        "json_schema",
        "schema",
        "strict",
        "id",
        "function",
        "arguments",
        "parameters",
        "description",
    }
)

# descriptions of the fields, vLLM's semantics; every field outside OPENAI_FIELDS has one
FIELD_DOCS = {
    "n": f"Number of choices per prompt (at most {MAX_N}).",
    "top_logprobs": f"Number of most likely tokens to return per position (0 to "
    f"{MAX_TOP_LOGPROBS}); needs `logprobs: true`.",
    "max_tokens": "Most tokens to generate. Completions default to 16; chat defaults to what "
    "the context leaves after the prompt.",
    "top_k": "vLLM extra: sample from the k most likely tokens only (0 or -1: all).",
    "min_p": "vLLM extra: drop tokens whose probability is below min_p times the most likely "
    "token's (0: off).",
    "repetition_penalty": "vLLM extra: divide the logits of tokens already in the prompt or "
    "the output by this (> 1 discourages repetition; 1: off).",
    "stop_token_ids": "vLLM extra: token ids that end generation (the token is not part of "
    "the text; `stop_reason` is the id).",
    "ignore_eos": "vLLM extra: keep generating after the end-of-sequence token.",
    "min_tokens": "vLLM extra: generate at least this many tokens before EOS or a stop may end "
    "the output.",
    "include_stop_str_in_output": "vLLM extra: keep the matched stop string in the text.",
    "skip_special_tokens": "vLLM extra: leave special tokens (BOS, EOS, turn markers...) out "
    "of the text (default true).",
    "spaces_between_special_tokens": "vLLM extra: put spaces between special tokens in the "
    "text when they are not skipped.",
    "structured_outputs": "vLLM extra: constrain the output with exactly one of `json` (a "
    "JSON schema), `regex`, `choice`, `grammar` (EBNF) or "
    "`json_object`.",
    "guided_json": "vLLM extra (deprecated form of `structured_outputs.json`).",
    "guided_regex": "vLLM extra (deprecated form of `structured_outputs.regex`).",
    "guided_choice": "vLLM extra (deprecated form of `structured_outputs.choice`).",
    "guided_grammar": "vLLM extra (deprecated form of `structured_outputs.grammar`).",
    "json": "A JSON schema (an object, or a string holding one) the output must match.",
    "regex": "A regular expression the output must match.",
    "choice": "The output is one of these strings.",
    "grammar": "An EBNF (GBNF) grammar the output must match.",
    "json_object": "The output is any JSON object.",
    "continuous_usage_stats": "vLLM extra: put the running `usage` on every chunk.",
    "add_special_tokens": "vLLM extra: add the tokenizer's special tokens (e.g. BOS) to the "
    "prompt (default true for completions and /tokenize).",
    "prompt_logprobs": "vLLM extra: number of top logprobs to return for every prompt token "
    "(the first position has none).",
    "add_generation_prompt": "vLLM extra: end the rendered conversation with the template's "
    "prompt for the assistant's turn (default true).",
    "continue_final_message": "vLLM extra: leave the final message open, so that the model "
    "continues it (instead of starting a new turn).",
    "chat_template": "vLLM extra, refused here: the server's template (--chat-template) is "
    "used, never one from the request.",
    "chat_template_kwargs": "vLLM extra: additional variables for the chat template.",
    "return_token_strs": "vLLM extra: also return each token's string.",
    "tokens": "Token ids to decode.",
}


def body_doc(
    model: type[BaseModel],
    response: type[BaseModel] | None = None,
    chunk: type[BaseModel] | None = None,
) -> dict:
    """`openapi_extra` for a route whose JSON body is `model`, answering `response` (or, with
    `stream: true`, server-sent events of `chunk`); errors are OpenAI-style."""
    ok: dict = {"description": "Successful Response", "content": {}}
    if response is not None:
        ok["content"]["application/json"] = {"schema": _ref(response)}
    if chunk is not None:
        ok["content"]["text/event-stream"] = {
            "schema": _ref(chunk),
            "description": "with `stream: true`: `data: <chunk>` events, then `data: [DONE]`",
        }
    error = {"content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(model)}}},
        "responses": {
            "200": ok,
            **{
                str(status): {"description": description, **error}
                for status, description in (
                    (400, "Invalid request"),
                    (401, "Missing or wrong API key"),
                    (404, "Unknown model"),
                    (413, "Request body too large"),
                    (503, "Overloaded or shutting down"),
                )
            },
        },
    }


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def document_bodies(
    app: FastAPI, requests: list[type[BaseModel]], responses: list[type[BaseModel]]
) -> None:
    """Make `app.openapi()` include the schemas of the request and response models (and what
    they reference), the request fields described."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(_schemas([*responses, ErrorResponse], "serialization"))
            for name, component in _schemas(requests, "validation").items():
                _describe(component)
                components[name] = component
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _schemas(models: list[type[BaseModel]], mode: str) -> dict:
    _, defs = models_json_schema([(m, mode) for m in models], ref_template=_REF)
    return defs.get("$defs", {})


def _describe(component: dict) -> None:
    for name, prop in component.get("properties", {}).items():
        if name in FIELD_DOCS and "description" not in prop:
            prop["description"] = FIELD_DOCS[name]
