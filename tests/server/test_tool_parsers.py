"""Tool-call parsers and the tool_choice plan, without a server: hermes and llama3_json on
whole texts and on every split of them into stream deltas, the `required` array and named
streams, `parallel_tool_calls`, and the 400s of bad tools and tool choices."""

import argparse
import json

import pytest

from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from vserve.entrypoints.openai.tool_calls import (
    ChoiceTools,
    NamedCallStream,
    RequiredCallsStream,
    message_tool_fields,
    plan_tools,
    required_schema,
)
from vserve.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from vserve.entrypoints.openai.tool_settings import ToolSettings

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/small"}},
            "required": ["a", "b"],
            "$defs": {"small": {"type": "integer", "maximum": 9}},
        },
    },
}

HERMES_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    '"Pa</tool_call>ris \\"x\\" {", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
    '{"arguments": "{\\"a\\": 1, \\"b\\": 2}", "name": "add"}\n</tool_call>'
)
HERMES_CALLS = [
    ("get_weather", '{"city": "Pa</tool_call>ris \\"x\\" {", "unit": "c"}'),
    ("add", '{"a": 1, "b": 2}'),
]


def calls_of(result):
    return [(c.name, c.arguments) for c in result[1]]


def streamed(parser, pieces):
    """Feed the pieces; returns (content, [(name, arguments)], every delta) as a client
    would assemble them, checking the OpenAI shape of each call's deltas on the way."""
    content, calls, deltas = "", {}, []
    for i, piece in enumerate(pieces):
        news = parser.feed(piece)
        if i == len(pieces) - 1:
            end = parser.finish()
            news.content += end.content
            news.tool_calls += end.tool_calls
        content += news.content
        for d in news.tool_calls:
            deltas.append(d)
            if d.index not in calls:
                assert d.index == len(calls) and d.id and d.name, d  # the first delta: id, name
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None and d.arguments, d
            calls[d.index][1] += d.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


def splits(text):
    """The text in one piece, cut at every position in two, and one character at a time."""
    yield [text]
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text)


def test_hermes_whole_text():
    content, calls = HermesToolParser().parse(HERMES_TEXT)
    assert content == "Let me look.\n"
    assert [(c.name, c.arguments) for c in calls] == HERMES_CALLS
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert len({c.id for c in calls}) == 2
    for _, args in HERMES_CALLS:
        json.loads(args)


def test_hermes_every_split_streams_the_same():
    for pieces in splits(HERMES_TEXT):
        content, calls, _ = streamed(HermesToolParser(), pieces)
        assert (content, calls) == ("Let me look.\n", HERMES_CALLS), pieces


def test_hermes_streams_name_first_then_fragments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}'
    _, calls, deltas = streamed(HermesToolParser(), list(text) + ["\n</tool_call>"])
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    assert len(deltas) > 10  # the arguments arrive as they are written
    assert calls == [("get_weather", '{"city": "Oslo", "unit": "f"}')]


def test_hermes_content_only_and_held_back_markup():
    for text in ("Hello there", "a < b and <tool", "x <tool_cal"):
        assert HermesToolParser().parse(text) == (text, [])
        for pieces in splits(text):
            assert streamed(HermesToolParser(), pieces)[:2] == (text, [])
    parser = HermesToolParser()
    assert parser.feed("Hi <tool_ca").content == "Hi "  # a possible tag is held back


def test_hermes_truncated_and_malformed_blocks():
    # cut off inside the arguments (finish_reason length): the call so far
    content, calls = HermesToolParser().parse('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1')]
    # no name: no call; no arguments: {}
    assert HermesToolParser().parse('<tool_call>{"arguments": {}}</tool_call>') == (None, [])
    _, calls = HermesToolParser().parse('<tool_call>{"name": "f"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}")]


def test_hermes_parallel_tool_calls_false_keeps_one():
    content, calls = HermesToolParser(max_calls=1).parse(HERMES_TEXT)
    assert [(c.name, c.arguments) for c in calls] == HERMES_CALLS[:1]


LLAMA_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", '
    '"unit": "c"}}; {"name": "add", "parameters": {"a": 3, "b": 4}}'
)
LLAMA_CALLS = [("get_weather", '{"city": "Rome", "unit": "c"}'), ("add", '{"a": 3, "b": 4}')]


def test_llama3_json():
    assert calls_of(Llama3JsonToolParser().parse(LLAMA_TEXT)) == LLAMA_CALLS
    assert Llama3JsonToolParser().parse(LLAMA_TEXT)[0] is None
    no_tag = LLAMA_TEXT.removeprefix("<|python_tag|>")
    assert calls_of(Llama3JsonToolParser().parse(" " + no_tag)) == LLAMA_CALLS
    for pieces in splits(LLAMA_TEXT):
        assert streamed(Llama3JsonToolParser(), pieces)[:2] == ("", LLAMA_CALLS)
    for text in ("The weather is fine.", "<|python", "  "):
        assert Llama3JsonToolParser().parse(text) == (text, [])
        for pieces in splits(text):
            assert streamed(Llama3JsonToolParser(), pieces)[:2] == (text, [])


def test_required_and_named_streams():
    text = (
        '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", '
        '"parameters": {"city": "]}", "unit": "f"}}]'
    )
    expect = [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "]}", "unit": "f"}')]
    assert calls_of(RequiredCallsStream().parse(text)) == expect
    for pieces in splits(text):
        assert streamed(RequiredCallsStream(), pieces)[:2] == ("", expect)
    args = '{"a": 5, "b": 6}'
    assert calls_of(NamedCallStream("add").parse(args)) == [("add", args)]
    _, calls, deltas = streamed(NamedCallStream("add"), ["", *args])
    assert calls == [("add", args)] and deltas[0].name == "add" and deltas[0].arguments == ""


# -- the plan: modes, constraints, 400s ------------------------------------------------------
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def request(**fields):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_plan_modes():
    assert plan_tools(request(), AUTO).mode == "none"
    plan = plan_tools(request(tools=[WEATHER]), AUTO)
    assert plan.mode == "auto" and plan.structured is None and plan.tools[0] == WEATHER
    plan = plan_tools(request(tools=[WEATHER], tool_choice="none"), ToolSettings())
    assert plan.mode == "none" and plan.tools == [WEATHER]  # still rendered
    plan = plan_tools(
        request(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False),
        ToolSettings(),
    )
    assert plan.mode == "required" and json.loads(plan.structured.json)["maxItems"] == 1
    plan = plan_tools(
        request(
            tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}
        ),
        ToolSettings(),
    )
    assert (
        plan.mode == "named" and json.loads(plan.structured.json) == ADD["function"]["parameters"]
    )
    assert plan_tools(request(tools=[], tool_choice="required"), AUTO).mode == "none"


def test_finish_reasons():
    def finish(choice, text):
        plan = plan_tools(request(tools=[WEATHER, ADD], tool_choice=choice), AUTO)
        parser = ChoiceTools(plan)
        parser.whole(text)
        return plan.finish_reason("stop", parser.called), plan.finish_reason(
            "length", parser.called
        )

    assert finish("auto", HERMES_TEXT) == ("tool_calls", "length")
    assert finish("auto", "no calls") == ("stop", "length")
    assert finish("required", '[{"name": "add", "parameters": {"a": 1, "b": 2}}]') == (
        "tool_calls",
        "length",
    )
    # a named function finishes with "stop", as OpenAI's API does
    assert finish({"type": "function", "function": {"name": "add"}}, '{"a": 1, "b": 2}') == (
        "stop",
        "length",
    )
    plan = plan_tools(request(tools=[WEATHER], tool_choice="none"), AUTO)
    assert not plan.parses and plan.finish_reason("stop", True) == "stop"


def test_required_schema_moves_defs_to_the_root():
    tools = request(tools=[WEATHER, ADD]).tools
    schema = required_schema(tools, None)
    assert schema["$defs"] == {"small": {"type": "integer", "maximum": 9}}
    assert '"$defs"' not in json.dumps(schema["items"]) and "maxItems" not in schema
    assert "$defs" in ADD["function"]["parameters"]  # the request is not changed
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),  # auto, no flag
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice",
            "not in `tools`",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
                "tool_choice": "none",
            },
            "tools",
            "letters, digits",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "none",
            },
            "tools",
            "of type object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": []}},
                    }
                ],
                "tool_choice": "none",
            },
            "tools",
            "properties",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools", "twice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            "cannot be combined",
        ),
        # constraints that are themselves invalid are still "combined" (a 500 found by the
        # fuzzer: building them raised a ValueError that nothing turned into a 400)
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_choice": []},
            "tool_choice",
            "cannot be combined",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "guided_choice": [],
                "guided_regex": "",
            },
            "tool_choice",
            "cannot be combined",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "response_format": {"type": "json_schema"},
            },
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_tools_are_400(fields, param, words):
    with pytest.raises(APIError) as e:
        plan_tools(request(**fields), ToolSettings())
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        {"tools": [{"type": "function"}]},
        {"tool_choice": "sometimes", "tools": [WEATHER]},
        {"tool_choice": {"type": "function"}, "tools": [WEATHER]},
    ],
)
def test_malformed_tool_fields_fail_validation(body):
    with pytest.raises(ValueError):
        request(**body)


def test_settings_from_args():
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolSettings.from_args(
            argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser=None)
        )

    class Token:
        def __init__(self, content, special):
            self.content, self.special = content, special

    class Tokenizer:
        added_tokens_decoder = {5: Token("<tool_call>", True), 6: Token("<b>", False)}

    args = argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser="hermes")
    settings = ToolSettings.from_args(args, Tokenizer())
    assert settings.keep_special_tokens  # else the detokenizer would drop <tool_call>
    Tokenizer.added_tokens_decoder = {5: Token("<tool_call>", False)}
    assert not ToolSettings.from_args(args, Tokenizer()).keep_special_tokens


def test_assistant_tool_calls_go_to_the_template_as_objects():
    msg = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        }
    )
    assert message_tool_fields(msg) == {
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
            }
        ]
    }
    tool = ChatMessage.model_validate({"role": "tool", "content": "3", "tool_call_id": "c1"})
    assert message_tool_fields(tool) == {"tool_call_id": "c1"}
    bad = msg.model_copy(deep=True)
    bad.tool_calls[0].function.arguments = "{not json"
    with pytest.raises(APIError) as e:
        message_tool_fields(bad)
    assert e.value.status == 400
