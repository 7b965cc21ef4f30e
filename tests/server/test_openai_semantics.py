"""OpenAI semantics, field by field: completions and chat, streamed and not,
against tables of the OpenAI API reference's objects (with vLLM's extras, as vLLM sends them):
object names, id prefixes, `created` in seconds, `system_fingerprint` (null), `usage` (with
`prompt_tokens_details.cached_tokens`, OpenAI's: the prompt tokens the prefix cache served),
stream usage, both `logprobs`
shapes, `finish_reason` / `stop_reason` for length, stop string, stop token and EOS, and the
error body of every status the server answers. The official `openai` client parses every
response into its typed models as well.

A live server on a tiny model; the errors that need no engine go to an engine-less app.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tests.support.openai_server import TINY_NAME, offline_app

MODEL = TINY_NAME
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]
EOS = 1  # the tiny models' </s>


# -- the reference's objects, as checkers ------------------------------------------------------
class Spec:
    def check(self, value, path: str) -> list[str]:
        raise NotImplementedError


class Is(Spec):
    def __init__(self, value) -> None:
        self.value = value

    def check(self, value, path):
        return [] if value == self.value else [f"{path}: {value!r} != {self.value!r}"]


class Type(Spec):
    def __init__(self, *types: type, nullable: bool = False) -> None:
        self.types, self.nullable = types, nullable

    def check(self, value, path):
        if value is None and self.nullable:
            return []
        ok = isinstance(value, self.types) and not (
            isinstance(value, bool) and bool not in self.types
        )
        return [] if ok else [f"{path}: {value!r} is not {self.types}"]


class Prefix(Spec):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def check(self, value, path):
        ok = isinstance(value, str) and value.startswith(self.prefix) and value != self.prefix
        return [] if ok else [f"{path}: {value!r} does not start with {self.prefix!r}"]


class Seconds(Spec):
    """Unix time in whole seconds, during this test session."""

    start = int(time.time())

    def check(self, value, path):
        ok = type(value) is int and self.start <= value <= time.time() + 1
        return [] if ok else [f"{path}: {value!r} is not a time in seconds"]


class ListOf(Spec):
    def __init__(self, item, length: int | None = None) -> None:
        self.item, self.length = item, length

    def check(self, value, path):
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        errors = (
            []
            if self.length in (None, len(value))
            else [f"{path}: {len(value)} items, expected {self.length}"]
        )
        for i, item in enumerate(value):
            errors += check(item, self.item, f"{path}[{i}]")
        return errors


class Nullable(Spec):
    def __init__(self, spec) -> None:
        self.spec = spec

    def check(self, value, path):
        return [] if value is None else check(value, self.spec, path)


class DictOf(Spec):
    def __init__(self, key: type, value: type) -> None:
        self.key, self.value = key, value

    def check(self, value, path):
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is not an object"]
        return [
            f"{path}[{k!r}]"
            for k, v in value.items()
            if not isinstance(k, self.key) or not isinstance(v, self.value)
        ]


def check(value, spec, path: str = "$") -> list[str]:
    """Mismatches of `value` against `spec`; a dict spec is the object's exact key set."""
    if isinstance(spec, Spec):
        return spec.check(value, path)
    if not isinstance(value, dict):
        return [f"{path}: {value!r} is not an object"]
    errors = [f"{path}.{k}: missing" for k in spec if k not in value]
    errors += [f"{path}.{k}: not in the reference" for k in value if k not in spec]
    for key in spec.keys() & value.keys():
        errors += check(value[key], spec[key], f"{path}.{key}")
    return errors


STR, INT, FLOAT = Type(str), Type(int), Type(float, int)
FINISH = Type(str, nullable=True)
STOP_REASON = Type(int, str, nullable=True)  # vLLM: the stop string or token id, else null
USAGE = {
    "prompt_tokens": INT,
    "completion_tokens": INT,
    "total_tokens": INT,
    "prompt_tokens_details": {"cached_tokens": INT},
}
COMPLETION_LOGPROBS = {
    "tokens": ListOf(STR),
    "token_logprobs": ListOf(FLOAT),
    "top_logprobs": ListOf(DictOf(str, float)),
    "text_offset": ListOf(INT),
}
# vLLM sends prompt_logprobs: null on every completion choice unless they were asked for
COMPLETION_CHOICE = {
    "index": INT,
    "text": STR,
    "logprobs": Nullable(COMPLETION_LOGPROBS),
    "finish_reason": FINISH,
    "stop_reason": STOP_REASON,
    "prompt_logprobs": Is(None),
}


def completion(num_choices: int = 1) -> dict:
    return {
        "id": Prefix("cmpl-"),
        "object": Is("text_completion"),
        "created": Seconds(),
        "model": Is(MODEL),
        "system_fingerprint": Is(None),
        "choices": ListOf(COMPLETION_CHOICE, num_choices),
        "usage": USAGE,
    }


def completion_chunk(num_choices: int | None = 1, usage=False) -> dict:
    spec = {
        "id": Prefix("cmpl-"),
        "object": Is("text_completion"),
        "created": Seconds(),
        "model": Is(MODEL),
        "system_fingerprint": Is(None),
        "choices": ListOf(COMPLETION_CHOICE, num_choices),
    }
    return {**spec, "usage": USAGE} if usage else spec


TOP_LOGPROB = {"token": STR, "logprob": FLOAT, "bytes": ListOf(INT)}
CHAT_LOGPROBS = {"content": ListOf({**TOP_LOGPROB, "top_logprobs": ListOf(TOP_LOGPROB)})}
# vLLM sends tool_calls: [] on a message without calls (OpenAI omits it; both clients accept it)
CHAT_MESSAGE = {
    "role": Is("assistant"),
    "content": STR,
    "reasoning_content": Is(None),
    "refusal": Is(None),
    "tool_calls": Is([]),
}
CHAT_CHOICE = {
    "index": INT,
    "message": CHAT_MESSAGE,
    "logprobs": Nullable(CHAT_LOGPROBS),
    "finish_reason": FINISH,
    "stop_reason": STOP_REASON,
}


def chat(num_choices: int = 1) -> dict:
    return {
        "id": Prefix("chatcmpl-"),
        "object": Is("chat.completion"),
        "created": Seconds(),
        "model": Is(MODEL),
        "system_fingerprint": Is(None),
        "choices": ListOf(CHAT_CHOICE, num_choices),
        "usage": USAGE,
    }


def chat_chunk(delta: dict, num_choices: int | None = 1, usage=False) -> dict:
    choice = {
        "index": INT,
        "delta": delta,
        "logprobs": Nullable(CHAT_LOGPROBS),
        "finish_reason": FINISH,
        "stop_reason": STOP_REASON,
    }
    spec = {
        "id": Prefix("chatcmpl-"),
        "object": Is("chat.completion.chunk"),
        "created": Seconds(),
        "model": Is(MODEL),
        "system_fingerprint": Is(None),
        "choices": ListOf(choice, num_choices),
    }
    return {**spec, "usage": USAGE} if usage else spec


ROLE_DELTA = {"role": Is("assistant"), "content": Is("")}
CONTENT_DELTA = {"content": STR}


def assert_matches(value, spec) -> None:
    errors = check(value, spec)
    assert not errors, "\n".join(errors) + "\n" + json.dumps(value)[:2000]


# -- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_server):
    return tiny_llama_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    """The events of a streamed response, parsed; ends with [DONE]."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
TYPED = {"model": MODEL, "temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def test_completion_object(server, client):
    body = post(
        server,
        "/v1/completions",
        {**GREEDY, "prompt": PROMPT, "n": 2, "temperature": 1.0, "seed": 0},
    )
    assert_matches(body, completion(2))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    typed = client.completions.create(prompt=PROMPT, **TYPED)
    assert typed.object == "text_completion" and typed.system_fingerprint is None
    assert typed.usage.prompt_tokens_details.cached_tokens >= 0
    greedy = post(server, "/v1/completions", {**GREEDY, "prompt": PROMPT})
    assert_matches(greedy, completion())
    assert typed.choices[0].text == greedy["choices"][0]["text"]


def test_chat_object(server, client):
    body = post(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES})
    assert_matches(body, chat())
    typed = client.chat.completions.create(messages=MESSAGES, **TYPED)
    assert typed.object == "chat.completion" and typed.id.startswith("chatcmpl-")
    assert typed.choices[0].message.role == "assistant"
    assert typed.choices[0].message.refusal is None
    assert typed.choices[0].message.content == body["choices"][0]["message"]["content"]
    assert typed.usage.completion_tokens == 6


def test_cached_tokens_count_prefix_cache_hits(server, client):
    """usage.prompt_tokens_details.cached_tokens: 0 for a prompt first seen, then the prompt
    tokens the prefix cache served (whole blocks of 16), summed over a batch's prompts, in
    chat, completions and a stream's usage chunk."""
    words = " ".join(f"w{i}" for i in range(40))  # a prompt no other test sends

    def cached(body) -> tuple[int, int]:
        usage = body["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    first = post(server, "/v1/completions", {**GREEDY, "prompt": words})
    assert cached(first)[0] == 0
    hit, total = cached(post(server, "/v1/completions", {**GREEDY, "prompt": words}))
    assert 16 <= hit < total and hit % 16 == 0
    both, _ = cached(post(server, "/v1/completions", {**GREEDY, "prompt": [words, words]}))
    assert both == 2 * hit
    messages = [{"role": "user", "content": words + " chat"}]
    assert cached(post(server, "/v1/chat/completions", {**GREEDY, "messages": messages}))[0] == 0
    again = client.chat.completions.create(messages=messages, **TYPED)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **TYPED
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens >= 16


def test_completion_stream(server, client):
    request = {**GREEDY, "prompt": PROMPT}
    whole = post(server, "/v1/completions", request)
    chunks = stream(
        server, "/v1/completions", {**request, "stream_options": {"include_usage": True}}
    )
    *content, last = chunks
    for chunk in content:
        assert_matches(chunk, completion_chunk())
    assert_matches(last, completion_chunk(0, usage=True))  # usage only: no choices
    assert last["usage"] == whole["usage"]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in content) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    # without include_usage no chunk has usage; with continuous_usage_stats every one does
    assert all("usage" not in c for c in stream(server, "/v1/completions", request))
    running = stream(
        server,
        "/v1/completions",
        {**request, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    for chunk in running[:-1]:
        assert_matches(chunk, completion_chunk(usage=True))
    # the client parses every chunk, the usage-only one too
    parsed = list(
        client.completions.create(
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **TYPED
        )
    )
    assert (
        parsed[-1].choices == [] and parsed[-1].usage.total_tokens == whole["usage"]["total_tokens"]
    )


def test_chat_stream(server, client):
    request = {**GREEDY, "messages": MESSAGES}
    whole = post(server, "/v1/chat/completions", request)
    chunks = stream(
        server, "/v1/chat/completions", {**request, "stream_options": {"include_usage": True}}
    )
    first, *content, last = chunks
    assert_matches(first, chat_chunk(ROLE_DELTA))
    for chunk in content:
        assert_matches(chunk, chat_chunk(CONTENT_DELTA))
    assert_matches(last, chat_chunk(CONTENT_DELTA, 0, usage=True))
    assert last["usage"] == whole["usage"]
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == whole["choices"][0]["message"]["content"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    parsed = list(
        client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **TYPED
        )
    )
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 6


def test_completion_logprobs(server, client):
    body = post(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "logprobs": 2})
    assert_matches(body, completion())
    lp = body["choices"][0]["logprobs"]
    num = body["usage"]["completion_tokens"]
    assert all(len(lp[k]) == num for k in lp), {k: len(v) for k, v in lp.items()}
    assert lp["text_offset"][0] == 0
    for i in range(num):
        top = lp["top_logprobs"][i]
        assert 2 <= len(top) <= 3  # the top 2, and the sampled token (vLLM's legacy format)
        assert lp["tokens"][i] in top and lp["token_logprobs"][i] == top[lp["tokens"][i]]
        assert lp["token_logprobs"][i] == max(top.values())  # greedy
        if i:
            assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    typed = client.completions.create(prompt=PROMPT, logprobs=2, **TYPED)
    assert typed.choices[0].logprobs.tokens == lp["tokens"]
    # streamed: the same entries, offsets continuing across chunks
    chunks = stream(server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "logprobs": 2})
    joined = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), []) for k in lp}
    assert joined == lp


def test_chat_logprobs(server, client):
    body = post(
        server,
        "/v1/chat/completions",
        {**GREEDY, "messages": MESSAGES, "logprobs": True, "top_logprobs": 3},
    )
    assert_matches(body, chat())
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert entry["token"] == tops[0]["token"] and entry["logprob"] == tops[0]["logprob"]
        for item in (entry, *tops):
            assert item["bytes"] == list(item["token"].encode("utf-8"))
    # logprobs without top_logprobs: no alternatives; no logprobs: null
    plain = post(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "logprobs": True})
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    none = post(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES})
    assert none["choices"][0]["logprobs"] is None
    typed = client.chat.completions.create(
        messages=MESSAGES, logprobs=True, top_logprobs=3, **TYPED
    )
    assert typed.choices[0].logprobs.content[0].top_logprobs[0].bytes == content[0]["bytes"]
    chunks = stream(
        server,
        "/v1/chat/completions",
        {**GREEDY, "messages": MESSAGES, "logprobs": True, "top_logprobs": 3},
    )
    streamed = sum((c["choices"][0]["logprobs"]["content"] for c in chunks[1:]), [])
    assert streamed == content


def _greedy_ids(server, path: str, extra: dict) -> tuple[list[int | None], str]:
    """The greedy output's token ids (None for a token whose text does not round-trip) and
    text."""
    body = post(
        server,
        path,
        {**GREEDY, **extra, "max_tokens": 12, "logprobs": 0}
        if path == "/v1/completions"
        else {**GREEDY, **extra, "max_tokens": 12, "logprobs": True},
    )
    choice = body["choices"][0]
    if path == "/v1/completions":
        tokens, text = choice["logprobs"]["tokens"], choice["text"]
    else:
        tokens = [e["token"] for e in choice["logprobs"]["content"]]
        text = choice["message"]["content"]
    ids = [
        post(server, "/tokenize", {"prompt": t, "add_special_tokens": False})["tokens"]
        for t in tokens
    ]
    return [i[0] if len(i) == 1 else None for i in ids], text


def _finish_cases(server, path: str, extra: dict) -> list[tuple]:
    """(name, request fields, finish_reason, stop_reason, completion_tokens) -- vLLM's
    values (a stop token counts as generated; its text is left out)."""
    ids, text = _greedy_ids(server, path, extra)
    # a stop string: two characters that first appear at some position p >= 1
    p = next(
        p
        for p in range(1, len(text) - 1)
        if text[p : p + 2].strip() and text.find(text[p : p + 2]) == p
    )
    stop = text[p : p + 2]
    # a stop token: the first later id that did not appear before (and round-trips)
    k = next(k for k in range(1, len(ids)) if ids[k] is not None and ids[k] not in ids[:k])
    return [
        ("length", {"max_tokens": 4}, "length", None, 4),
        ("stop string", {"max_tokens": 12, "stop": [stop]}, "stop", stop, None),
        ("stop token", {"max_tokens": 12, "stop_token_ids": [ids[k]]}, "stop", ids[k], k + 1),
        (
            "eos",
            {"max_tokens": 12, "ignore_eos": False, "logit_bias": {str(EOS): 100}},
            "stop",
            None,
            1,
        ),
    ]


def _text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_finish_and_stop_reasons(server):
    for path, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        for name, fields, finish, stop_reason, num in _finish_cases(server, path, extra):
            request = {**GREEDY, **extra, **fields}
            body = post(server, path, request)
            choice = body["choices"][0]
            got = (choice["finish_reason"], choice["stop_reason"])
            assert got == (finish, stop_reason), (name, path, got)
            last = stream(server, path, request)[-1]["choices"][0]
            assert (last["finish_reason"], last["stop_reason"]) == got, (name, path, "stream")
            if num is not None:
                assert body["usage"]["completion_tokens"] == num, (name, path)
            if name == "stop string":
                assert stop_reason not in _text(choice), (path, _text(choice))
            if name == "eos":
                assert _text(choice) == "", path


# -- errors ------------------------------------------------------------------------------------
ERROR = {"error": {"message": STR, "type": STR, "param": Type(str, nullable=True), "code": INT}}


def _error(response: httpx.Response, status: int, kind: str, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert_matches(body, ERROR)
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (
        kind,
        param,
        status,
    ), body


def test_errors_from_the_engine_side(server, client):
    url = server.url
    _error(
        httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "temperature": -1}),
        400,
        "BadRequestError",
        "temperature",
    )
    _error(
        httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000}),
        400,
        "BadRequestError",
        "max_tokens",
    )
    _error(
        httpx.post(url + "/v1/chat/completions", json={"messages": []}),
        400,
        "BadRequestError",
        "messages",
    )
    _error(
        httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "model": "nope"}),
        404,
        "NotFoundError",
        "model",
    )
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.body["type"] == "NotFoundError"


def test_errors_at_the_front_door():
    app = offline_app(api_key="secret", max_request_body_bytes=1000)
    http = TestClient(app, base_url="http://127.0.0.1")
    auth = {"Authorization": "Bearer secret"}
    _error(http.post("/v1/completions", json={"prompt": "x"}), 401, "AuthenticationError", None)
    _error(
        http.post(
            "/v1/completions",
            headers=auth,
            content=b"{nope",
        ),
        400,
        "BadRequestError",
        None,
    )
    _error(
        http.post("/v1/completions", headers=auth, json={"prompt": "x" * 2000}),
        413,
        "RequestTooLargeError",
        None,
    )
    _error(http.get("/v1/nothing-here", headers=auth), 404, "NotFoundError", None)
    _error(http.get("/v1/completions", headers=auth), 405, "Method Not Allowed", None)
    client = openai.OpenAI(
        base_url="http://127.0.0.1/v1", api_key="wrong", max_retries=0, http_client=http
    )
    with pytest.raises(openai.AuthenticationError) as denied:
        client.models.list()
    assert denied.value.body["type"] == "AuthenticationError"
    app.state.ctx.draining = True
    _error(
        http.post("/v1/completions", headers=auth, json={"prompt": "x"}),
        503,
        "ServiceUnavailableError",
        None,
    )
