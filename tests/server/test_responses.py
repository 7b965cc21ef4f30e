"""`POST /v1/responses` through the official `openai` client, unmodified: `responses.create`
and `responses.stream` against a live server on a tiny model, each answer checked against the
chat completion of the same conversation (greedy); function tools and their outputs,
`text.format` json_schema, `previous_response_id`, and the store's bound."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.support.openai_server import TINY_ARGS, serving
from vserve.entrypoints.openai.serving_responses import ResponseStore

GREEDY = {"temperature": 0, "max_output_tokens": 8}
TOOLS = [
    {
        "type": "function",
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = [tiny_model_dir("qwen2"), *TINY_ARGS, "--enable-auto-tool-choice"]
    with serving([*args, "--tool-call-parser", "hermes"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat_text(client, model, messages) -> str:
    out = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=8
    )
    return out.choices[0].message.content


@pytest.mark.slow
def test_text_input_is_the_chat_reply(client, model):
    response = client.responses.create(model=model, input="Paris is", **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat_text(
        client, model, [{"role": "user", "content": "Paris is"}]
    )
    assert response.status == "incomplete"  # 8 tokens, no end of text
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 8


@pytest.mark.slow
def test_instructions_and_message_items(client, model):
    items = [
        {"role": "user", "content": "1 2 3"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "4 5"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "6 7"}]},
    ]
    response = client.responses.create(model=model, instructions="Count.", input=items, **GREEDY)
    messages = [
        {"role": "system", "content": "Count."},
        {"role": "user", "content": "1 2 3"},
        {"role": "assistant", "content": "4 5"},
        {"role": "user", "content": "6 7"},
    ]
    assert response.output_text == chat_text(client, model, messages)


@pytest.mark.slow
def test_stream_events_build_the_same_response(client, model):
    whole = client.responses.create(model=model, input="Paris is", **GREEDY)
    with client.responses.stream(model=model, input="Paris is", **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.id.startswith("resp_")
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and final.status == "incomplete"
    assert "response.output_text.delta" in kinds
    raw = client.responses.create(model=model, input="Paris is", stream=True, **GREEDY)
    numbers = [event.sequence_number for event in raw]
    assert numbers == list(range(len(numbers)))


@pytest.mark.slow
def test_a_stream_carries_line_separators_inside_its_text(client, model):
    """U+2028 / U+2029 stay raw in JSON strings: the events are split at newlines only."""
    text = "x\u2028y\u2029z"
    kwargs = {"model": model, "input": "hi", "temperature": 0, "max_output_tokens": 20}
    kwargs["extra_body"] = {"guided_regex": re.escape(text)}
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_text == text and final.status == "completed"


@pytest.mark.slow
def test_function_call_then_its_output_continues_the_conversation(client, model):
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    forced = dict(  # a call the regex writes
        model=model,
        input="Weather in Paris?",
        tools=TOOLS,
        temperature=0,
        max_output_tokens=120,
        extra_body={"guided_regex": re.escape(call)},
    )
    first = client.responses.create(**forced)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    follow = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        **GREEDY,
    )
    # the stored turn (question and call) and the tool's output were rendered before it
    assert follow.usage.input_tokens > first.usage.input_tokens + len(call) // 4
    with client.responses.stream(**forced) as stream:
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


@pytest.mark.slow
def test_json_schema_text_format(client, model):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model,
        input="A number:",
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema}},
    )
    assert isinstance(json.loads(response.output_text)["n"], int)


@pytest.mark.slow
def test_an_unknown_previous_response_is_404(client, model):
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=model, input="hi", previous_response_id="resp_gone")


@pytest.mark.slow
def test_unsupported_input_is_a_clear_400(client, model):
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=model, input="hi", background=True)
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=model, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="input_image"):
        client.responses.create(
            model=model,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        )


def test_the_store_evicts_the_least_recently_used():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [{"role": "user", "content": "2"}])
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", [{"role": "user", "content": "3"}])
    assert store.get("b") is None and store.get("a") and store.get("c")
    small = ResponseStore(max_responses=10, max_chars=100)
    small.put("x", [{"role": "user", "content": "y" * 60}])
    small.put("z", [{"role": "user", "content": "w" * 60}])
    assert small.get("x") is None and small.get("z") and small.num_chars <= 100
    small.put("huge", [{"role": "user", "content": "v" * 200}])  # never kept
    assert small.get("huge") is None and small.get("z")
