"""With a reasoning parser, a structured-output constraint applies to the answer: after
`</think>`, the thoughts free; from the first token when the prompt closed the thought
(thinking off).

A live server on a tiny model whose `</think>` is one token and whose template opens the
thought (DeepSeek-R1's habit, `--reasoning-parser deepseek_r1`); `logit_bias` pushes
`</think>` up, so the reply closes its (empty) thought at once. Through the official
`openai` client: the answer is the constrained one, whole, streamed and as a JSON schema's
object; with thinking off the tag is masked out from the first token and all is content.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.support.openai_server import TINY_ARGS, serving
from tests.support.tiny_models import thinking_model

pytestmark = pytest.mark.slow  # a server of its own

ANSWER = r"[x-z]{3,6}"
MESSAGES = [{"role": "user", "content": "Think first."}]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    args = [thinking_model(tiny_model_dir), *TINY_ARGS, "--reasoning-parser", "deepseek_r1"]
    with serving(args) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _ask(client, extra_body: dict | None = None, **kwargs):
    end = "385"  # </think>
    return client.chat.completions.create(
        **{"max_tokens": 40, **kwargs},
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        temperature=0,
        logit_bias={end: 50},
        logprobs=True,
        extra_body={"guided_regex": ANSWER, **(extra_body or {})},
    )


def _tokens(choice) -> list[str]:
    return [t.token for t in choice.logprobs.content]


def test_the_answer_is_constrained_after_the_thoughts(client):
    choice = _ask(client).choices[0]
    message = choice.message
    assert _tokens(choice)[0] == "</think>"  # free: the pushed-up tag came first
    assert message.reasoning_content is None  # the thought closed at once
    assert re.fullmatch(ANSWER, message.content), message
    content = []
    for chunk in _ask(client, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.content:
            content.append(delta.content)
    assert "".join(content) == message.content


def test_a_json_schema_applies_after_the_thoughts(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    format_ = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    choice = _ask(client, extra_body={"guided_regex": None}, response_format=format_).choices[0]
    message = choice.message
    assert _tokens(choice)[0] == "</think>"
    assert json.loads(message.content)["answer"] in ("yes", "no"), message


def test_with_thinking_off_the_constraint_starts_at_once(client):
    """The prompt closed the thought: `</think>`, pushed up, is masked from the first token."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    choice = _ask(client, extra_body=off).choices[0]
    message = choice.message
    assert "</think>" not in _tokens(choice)
    assert message.reasoning_content is None
    assert re.fullmatch(ANSWER, message.content), message
