"""The OpenAPI document: every POST route's request body is a schema with
vLLM's field names and types, every field outside the OpenAI API is described, the 200
responses are documented, and /docs serves the Swagger UI for the document. No engine: the
app is built over a stand-in (`offline_app`)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.support.openai_server import offline_app
from vserve.entrypoints.openai.openapi import OPENAI_FIELDS

# route -> (request schema, {field: JSON types}, required fields), vLLM's names and types
BODIES = {
    "/v1/completions": (
        "CompletionRequest",
        {
            "model": {"string"},
            "prompt": {"string", "array"},
            "max_tokens": {"integer"},
            "echo": {"boolean"},
            "logprobs": {"integer"},
            "n": {"integer"},
            "stop": {"string", "array"},
            "stream": {"boolean"},
            "stream_options": {"object"},
            "temperature": {"number"},
            "top_p": {"number"},
            "top_k": {"integer"},
            "min_p": {"number"},
            "presence_penalty": {"number"},
            "frequency_penalty": {"number"},
            "repetition_penalty": {"number"},
            "seed": {"integer"},
            "stop_token_ids": {"array"},
            "ignore_eos": {"boolean"},
            "min_tokens": {"integer"},
            "include_stop_str_in_output": {"boolean"},
            "skip_special_tokens": {"boolean"},
            "spaces_between_special_tokens": {"boolean"},
            "logit_bias": {"object"},
            "add_special_tokens": {"boolean"},
            "response_format": {"object"},
            "structured_outputs": {"object"},
            "user": {"string"},
        },
        {"prompt"},
    ),
    "/v1/embeddings": (
        "EmbeddingRequest",
        {
            "model": {"string"},
            "input": {"string", "array"},
            "encoding_format": {"string"},
            "dimensions": {"integer"},
            "user": {"string"},
            "add_special_tokens": {"boolean"},
        },
        {"input"},
    ),
    "/v1/chat/completions": (
        "ChatCompletionRequest",
        {
            "model": {"string"},
            "messages": {"array"},
            "max_tokens": {"integer"},
            "max_completion_tokens": {"integer"},
            "logprobs": {"boolean"},
            "top_logprobs": {"integer"},
            "n": {"integer"},
            "stop": {"string", "array"},
            "stream": {"boolean"},
            "stream_options": {"object"},
            "temperature": {"number"},
            "top_p": {"number"},
            "top_k": {"integer"},
            "seed": {"integer"},
            "response_format": {"object"},
            "structured_outputs": {"object"},
            "add_generation_prompt": {"boolean"},
            "continue_final_message": {"boolean"},
            "chat_template_kwargs": {"object"},
            "skip_special_tokens": {"boolean"},
        },
        {"messages"},
    ),
    "/v1/responses": (
        "ResponsesRequest",
        {
            "model": {"string"},
            "input": {"string", "array"},
            "instructions": {"string"},
            "max_output_tokens": {"integer"},
            "temperature": {"number"},
            "tools": {"array"},
            "text": {"object"},
            "stream": {"boolean"},
            "previous_response_id": {"string"},
            "store": {"boolean"},
        },
        {"input"},
    ),
    "/tokenize": (
        "TokenizeRequest",
        {
            "model": {"string"},
            "prompt": {"string"},
            "messages": {"array"},
            "add_special_tokens": {"boolean"},
            "add_generation_prompt": {"boolean"},
            "return_token_strs": {"boolean"},
        },
        set(),
    ),
    "/detokenize": ("DetokenizeRequest", {"model": {"string"}, "tokens": {"array"}}, {"tokens"}),
}
RESPONSES = {
    "/v1/completions": ("CompletionResponse", "CompletionChunk"),
    "/v1/chat/completions": ("ChatCompletionResponse", "ChatCompletionChunk"),
    "/tokenize": ("TokenizeResponse", None),
    "/detokenize": ("DetokenizeResponse", None),
}


@pytest.fixture(scope="module")
def client():
    return TestClient(offline_app(), base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def document(client):
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _types(prop: dict, schemas: dict) -> set[str]:
    """The JSON types a property accepts (a $ref counts as its target's type), null left out."""
    if "$ref" in prop:
        return _types(schemas[prop["$ref"].rsplit("/", 1)[1]], schemas)
    if "anyOf" in prop:
        return set().union(*(_types(p, schemas) for p in prop["anyOf"])) - {"null"}
    if "properties" in prop or prop.get("type") == "object":
        return {"object"}
    return {prop["type"]} if "type" in prop else set()


def _schema_of(ref_holder: dict, schemas: dict) -> tuple[str, dict]:
    name = ref_holder["schema"]["$ref"].rsplit("/", 1)[1]
    return name, schemas[name]


def test_every_post_route_documents_its_body(document):
    schemas = document["components"]["schemas"]
    posts = {path for path, ops in document["paths"].items() if "post" in ops} - {"/ping"}
    assert posts == set(BODIES), "a POST route without a documented body (or a stale table)"
    for path, (name, fields, required) in BODIES.items():
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True, path
        found, schema = _schema_of(body["content"]["application/json"], schemas)
        assert found == name, path
        props = schema["properties"]
        for field, types in fields.items():
            assert field in props, f"{path}: {field} is not in {name}"
            assert _types(props[field], schemas) == types, (path, field, props[field])
        assert set(schema.get("required", [])) == required, path


def test_every_vllm_extra_field_is_described(document):
    schemas = document["components"]["schemas"]
    undocumented = []
    for name, _, _ in BODIES.values():
        for nested in _request_models(name, schemas):
            for field, prop in schemas[nested]["properties"].items():
                if field not in OPENAI_FIELDS and not prop.get("description"):
                    undocumented.append(f"{nested}.{field}")
    assert not undocumented, undocumented
    top_k = schemas["CompletionRequest"]["properties"]["top_k"]["description"]
    assert top_k.startswith("vLLM extra")


def _request_models(name: str, schemas: dict, seen: set | None = None) -> set[str]:
    """`name` and every schema it references, transitively."""
    seen = seen if seen is not None else set()
    if name in seen:
        return seen
    seen.add(name)
    text = repr(schemas[name])
    for other in schemas:
        if f"'#/components/schemas/{other}'" in text:
            _request_models(other, schemas, seen)
    return seen


def test_responses_are_documented(document):
    schemas = document["components"]["schemas"]
    for path, (response, chunk) in RESPONSES.items():
        responses = document["paths"][path]["post"]["responses"]
        name, schema = _schema_of(responses["200"]["content"]["application/json"], schemas)
        assert name == response
        if chunk is not None:
            assert _schema_of(responses["200"]["content"]["text/event-stream"], schemas)[0] == chunk
        for status in ("400", "401", "404", "413", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (path, status)
    usage = schemas["UsageInfo"]["properties"]
    assert {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"} <= set(
        usage
    )
    assert "system_fingerprint" in schemas["ChatCompletionChunk"]["properties"]


def test_docs_page_serves_the_document(client):
    page = client.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    assert "/openapi.json" in page.text


def test_operation_ids_are_unique(document):
    """SDK generators name methods after operation ids; /ping's GET and POST once shared one."""
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
