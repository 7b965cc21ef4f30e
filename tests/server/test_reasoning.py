"""`--reasoning-parser`: a thinking model's `<think>...</think>` as `reasoning_content`, apart
from `content`, whole and streamed.

The parsers on texts cut at every pair of positions (a tag split inside one delta or across
two or three): the streamed pieces join to the whole reply's split, and no piece of content
or reasoning holds a tag's characters. Then a live server on a tiny model whose replies are
forced by a regex to think first (`guided_regex`, applied to the thoughts as well), through
the official `openai` client: the message's and the stream's reasoning and content,
`chat_template_kwargs`' `enable_thinking` reaching the template, and the tool parser reading
the content alone.
"""

from __future__ import annotations

import itertools
import json
import re

import openai
import pytest

from tests.support.openai_server import TINY_ARGS, serving
from vserve.entrypoints.openai.reasoning import ReasoningStream, split

CASES = {
    "qwen3": [
        ("<think>\nabc</think>\n\nThe answer", "\nabc", "\n\nThe answer"),
        ("The answer", None, "The answer"),  # thinking off: no <think>, all content
        ("  <thin", None, "  <thin"),  # a reply that only looked like a tag
        ("<think>a</thi", "a</thi", None),  # cut off while thinking
        (" <think>x</think>y</think>z", "x", "y</think>z"),
    ],
    "deepseek_r1": [
        ("abc</think>answer", "abc", "answer"),  # the template opened <think>
        ("<think>abc</think>answer", "abc", "answer"),  # one the model wrote is dropped
        ("a</b</think>c", "a</b", "c"),
        ("never closed", "never closed", None),
    ],
}


@pytest.mark.parametrize(
    "parser, text, reasoning, content",
    [(p, *case) for p, cases in CASES.items() for case in cases],
)
def test_split_and_every_streamed_cut_agree(parser, text, reasoning, content):
    whole = split(parser, text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        stream = ReasoningStream(parser)
        pieces = [stream.feed(text[:i]), stream.feed(text[i:j]), stream.feed(text[j:], True)]
        assert "".join(r for r, _ in pieces) == (reasoning or ""), (i, j)
        assert "".join(c for _, c in pieces) == (content or ""), (i, j)


def test_deepseek_r1_under_a_constraint_from_the_first_token_parses_no_reasoning():
    """A constraint that applies from the first token (the prompt closed the thought, or
    --structured-outputs-in-reasoning) leaves deepseek_r1's implicit thought open for ever,
    so the whole (constrained) reply would become reasoning: it stays content. One that
    starts after </think> leaves the parser as it is."""
    from vserve.entrypoints.openai.serving_chat import _reasoning_parser
    from vserve.sampling_params import SamplingParams, StructuredOutputsParams

    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="x+"))
    after = StructuredOutputsParams(regex="x+", starts_after="</think>")
    assert _reasoning_parser("deepseek_r1", constrained) is None
    assert _reasoning_parser("deepseek_r1", SamplingParams(structured_outputs=after)) == (
        "deepseek_r1"
    )
    assert _reasoning_parser("deepseek_r1", SamplingParams()) == "deepseek_r1"
    assert _reasoning_parser("qwen3", constrained) == "qwen3"  # it thinks only if it opens so
    assert _reasoning_parser(None, constrained) is None


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="one of deepseek_r1, qwen3"):
        ReasoningStream("o1")


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
THINKING = r"<think>[a-c]{3,6}</think>[x-z]{3,6}"
MESSAGES = [{"role": "user", "content": "Think first."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    # the constraint covers the thoughts: a regex forces this random model to think
    args = [tiny_model_dir("qwen2"), *TINY_ARGS, "--reasoning-parser", "qwen3"]
    args += ["--structured-outputs-in-reasoning"]
    args += ["--chat-template", str(template), "--enable-auto-tool-choice"]
    with serving([*args, "--tool-call-parser", "hermes"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _forced(client, regex: str, **kwargs):
    body = {"guided_regex": regex}
    extra_body = {**body, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        **{"max_tokens": 40, **kwargs},
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        temperature=0,
        extra_body=extra_body,
    )


@pytest.mark.slow
def test_the_message_holds_the_thoughts_apart(client):
    message = _forced(client, THINKING).choices[0].message
    assert re.fullmatch(r"[a-c]{3,6}", message.reasoning_content), message
    assert re.fullmatch(r"[x-z]{3,6}", message.content), message


@pytest.mark.slow
def test_the_stream_splits_at_tags_across_deltas(client):
    whole = _forced(client, THINKING).choices[0].message
    reasoning, content = [], []
    for chunk in _forced(client, THINKING, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            content.append(delta.content)
    assert len(reasoning) >= 2  # the thoughts came in pieces, the tags held back between them
    assert "".join(reasoning) == whole.reasoning_content
    assert "".join(content) == whole.content
    assert not any("<" in piece or ">" in piece for piece in reasoning + content)


@pytest.mark.slow
def test_a_responses_stream_closes_the_thoughts_before_the_message(client):
    """Through /v1/responses: a reasoning item, then the message; the reasoning item is done
    before the message is added, as OpenAI orders them."""
    model = client.models.list().data[0].id
    stream = client.responses.create(
        model=model,
        input="Think first.",
        temperature=0,
        max_output_tokens=40,
        stream=True,
        extra_body={"guided_regex": THINKING},
    )
    events = [(e.type, getattr(e, "output_index", None)) for e in stream]
    added = [i for i, (kind, _) in enumerate(events) if kind == "response.output_item.added"]
    done = [i for i, (kind, _) in enumerate(events) if kind == "response.output_item.done"]
    assert [events[i][1] for i in added] == [0, 1] and [events[i][1] for i in done] == [0, 1]
    assert done[0] < added[1]
    final = client.responses.create(
        model=model,
        input="Think first.",
        temperature=0,
        max_output_tokens=40,
        extra_body={"guided_regex": THINKING},
    )
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert re.fullmatch(r"[x-z]{3,6}", final.output_text)


@pytest.mark.slow
def test_without_a_think_tag_the_reply_is_content(client):
    message = _forced(client, r"[x-z]{4}").choices[0].message
    assert message.reasoning_content is None and re.fullmatch(r"[x-z]{4}", message.content)


@pytest.mark.slow
def test_enable_thinking_reaches_the_template(client):
    on = _forced(client, r"[x-z]{4}")
    off = _forced(
        client, r"[x-z]{4}", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # <think></think> was rendered


@pytest.mark.slow
def test_tool_calls_are_read_from_the_content_alone(client):
    """A tool call written inside the thoughts is thinking, not a call; the one after
    </think> is the call."""
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    regex = re.escape(f"<think>{call}</think>{call}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    choice = _forced(client, regex, tools=tools, max_tokens=300).choices[0]
    assert choice.message.reasoning_content == call
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"x": 1}]
    assert choice.finish_reason == "tool_calls"
