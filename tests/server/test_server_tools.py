"""Tool calling through the official `openai` client, streaming and not, on a tiny random
Qwen3 with a Qwen-style chat template (a `tools` section and `<tool_call>` blocks) and
`--enable-auto-tool-choice --tool-call-parser hermes`.

Random weights never call a tool on their own, so: `required` and named choices are
constrained (their arguments must parse and match the schema whatever the weights), `auto`
runs the hermes parser over text that a regex constraint forces the model to write, `none`
leaves that same text as content, and a conversation with tool calls and tool results goes
back through the template."""

import json

import httpx
import jsonschema_rs
import openai
import pytest

from tests.support.openai_server import TINY_ARGS, serving

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

QWEN_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\nCall as <tool_call>\n{"name": .., "arguments": ..}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                # length-bounded: xgrammar alone lets raw control characters into such strings
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen_tools.jinja"
    template.write_text(QWEN_TEMPLATE)
    with serving(
        [
            tiny_model_dir("qwen3"),
            *TINY_ARGS,
            "--max-model-len",
            "1024",
            "--served-model-name",
            "tiny",
            "--chat-template",
            str(template),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def chat(client, **kwargs):
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", **kwargs)


def stream_chat(client, **kwargs):
    """(content, [(id, name, arguments)], finish_reason) assembled from the chunks, with
    the OpenAI shape of every tool-call delta checked."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.index not in calls:  # a call's first delta: id, type, name
                    assert d.index == len(calls) and d.id and d.type == "function"
                    assert d.function.name and d.function.arguments is not None
                    calls[d.index] = [d.id, d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments or ""
            if choice.finish_reason is not None:
                assert finish is None
                finish = choice.finish_reason
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def check_arguments(name, arguments):
    jsonschema_rs.validate(SCHEMAS[name], json.loads(arguments))


def named(calls):
    return [(name, args) for *_, name, args in calls]


def test_required_one_call(client):
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function"
    assert calls[0].id.startswith("chatcmpl-tool-")
    check_arguments(calls[0].function.name, calls[0].function.arguments)
    content, streamed, finish = stream_chat(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=100
    )
    assert (content, finish) == ("", "tool_calls")
    assert named(streamed) == [(calls[0].function.name, calls[0].function.arguments)]


def test_required_parallel_calls_parse(client):
    r = chat(client, tools=TOOLS, tool_choice="required", max_tokens=60)
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason in ("tool_calls", "length")
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    for call in complete:
        check_arguments(call.function.name, call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)


def test_named_function(client):
    choice_ = {"type": "function", "function": {"name": "add"}}
    r = chat(client, tools=TOOLS, tool_choice=choice_, max_tokens=40)
    choice = r.choices[0]
    # OpenAI answers a named tool_choice with finish_reason "stop"
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "add"
    check_arguments("add", call.function.arguments)
    content, streamed, finish = stream_chat(client, tools=TOOLS, tool_choice=choice_, max_tokens=40)
    assert (content, finish) == ("", "stop")
    assert named(streamed) == [("add", call.function.arguments)]


def forced(text):
    """A regex that only `text` matches (the model must write exactly it)."""
    special = set("\\.^$|?*+()[]{}")
    escaped = "".join("\\" + c if c in special else "\\n" if c == "\n" else c for c in text)
    return {"structured_outputs": {"regex": escaped}}


def test_auto_parses_hermes_calls(client):
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text = "Sure.\n" + CALL_TEXT + "\n" + add
    expect = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 1, "b": 2}')]
    r = chat(client, tools=TOOLS, max_tokens=200, extra_body=forced(text))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.\n"
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == expect
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    content, streamed, finish = stream_chat(
        client, tools=TOOLS, tool_choice="auto", max_tokens=200, extra_body=forced(text)
    )
    assert (content, named(streamed), finish) == ("Sure.\n", expect, "tool_calls")


def test_auto_without_a_call_is_content(client):
    text = "It is sunny."
    r = chat(client, tools=TOOLS, max_tokens=60, extra_body=forced(text))
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert stream_chat(client, tools=TOOLS, max_tokens=60, extra_body=forced(text)) == (
        text,
        [],
        "stop",
    )


def test_none_leaves_the_text_and_still_renders_tools(client):
    r = chat(client, tools=TOOLS, tool_choice="none", max_tokens=150, extra_body=forced(CALL_TEXT))
    assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert stream_chat(
        client, tools=TOOLS, tool_choice="none", max_tokens=150, extra_body=forced(CALL_TEXT)
    ) == (CALL_TEXT, [], "stop")
    with_auto = chat(client, tools=TOOLS, max_tokens=1)
    without = chat(client, max_tokens=1)
    assert (
        r.usage.prompt_tokens == with_auto.usage.prompt_tokens > without.usage.prompt_tokens + 100
    )


def test_tool_results_round_trip(server, client):
    first = (
        chat(
            client,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=60,
        )
        .choices[0]
        .message
    )
    [call] = first.tool_calls
    messages = [
        *USER,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"},
    ]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    r = chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length")
    # what the template made of it
    ids = httpx.post(
        server.url + "/tokenize",
        json={"model": "tiny", "messages": messages, "tools": TOOLS},
        timeout=30,
    )
    assert ids.status_code == 200, ids.text
    assert ids.json()["count"] == r.usage.prompt_tokens
    text = httpx.post(
        server.url + "/detokenize", json={"tokens": ids.json()["tokens"]}, timeout=30
    ).json()["prompt"]
    # the template's tojson
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        f"{arguments}}}\n</tool_call><|im_end|>"
    ) in text
    assert "<|im_start|>user\n<tool_response>\n22 degrees\n</tool_response><|im_end|>" in text
    assert '"name": "add"' in text.split("</tools>")[0]


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "letters"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in `tools`",
        ),
        ({"tool_choice": "required"}, "`tools` must be set"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "JSON schema",
        ),
        (
            {
                "tools": TOOLS,
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "add", "arguments": "{x"},
                            }
                        ],
                    },
                ],
            },
            "not valid JSON",
        ),
    ],
)
def test_bad_tool_requests_are_400(client, fields, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=5, **fields)
    assert e.value.status_code == 400 and words in str(e.value)
