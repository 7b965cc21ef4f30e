"""Bad input never hurts the server: every row of the table gets its status and an OpenAI-style
error body, the engine stays up (same engine process, still answering), and requests beyond
the waiting-queue limit get 503 with Retry-After. The server runs with an API key, so the
table also covers missing and wrong keys and the routes that stay open."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.support.openai_server import TINY_ARGS, children_of, serving

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256
PROMPT = "The quick brown fox"
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(
        [
            tiny_model_dir("llama"),
            *TINY_ARGS,
            "--api-key",
            KEY,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "1",
            "--max-num-queued-reqs",
            "2",
        ]
    ) as srv:
        yield srv


DEEP_SCHEMA: dict = {"type": "integer"}
for _ in range(200):  # 201 levels of JSON (the cap is 128)
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}


def C(**body):
    return ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **body})


def CHAT(**body):
    return ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **body})


BAD_JSON_ROWS = [
    # (route and body, status, part of the message)
    (C(max_tokens="many"), 400, "max_tokens"),
    (C(prompt=123), 400, "prompt"),
    (C(prompt=None), 400, "prompt"),
    (("/v1/completions", {"max_tokens": 4}), 400, "prompt"),
    (C(temperature=-1), 400, "temperature"),
    (C(temperature="hot"), 400, "temperature"),
    (C(top_p=1.5), 400, "top_p must be in (0, 1]"),
    (C(top_k=-5), 400, "top_k"),
    (C(min_p=2), 400, "min_p"),
    (C(presence_penalty=3), 400, "presence_penalty"),
    (C(repetition_penalty=0), 400, "repetition_penalty"),
    (C(max_tokens=0), 400, "max_tokens"),
    (C(max_tokens=-1), 400, "max_tokens"),
    (C(min_tokens=20, max_tokens=10), 400, "min_tokens"),
    (C(logprobs=-1), 400, "logprobs"),
    (C(logprobs=50), 400, "logprobs"),
    (C(n=129), 400, "n must be between 1 and 128"),
    (C(n=0), 400, "n must be"),
    (C(n=2, temperature=0), 400, "n > 1"),
    (C(stop=[""]), 400, "stop"),
    (C(stop=5), 400, "stop"),
    (C(seed=2**70), 400, "seed"),
    (C(model="no-such-model"), 404, "does not exist"),
    (C(prompt="word " * 300), 400, f"maximum context length is {MAX_MODEL_LEN}"),
    (C(max_tokens=MAX_MODEL_LEN), 400, f"maximum context length is {MAX_MODEL_LEN}"),
    (C(prompt=[2, 5, 999999]), 400, "out of vocabulary"),
    (C(prompt=[2, -5]), 400, "prompt"),
    (C(prompt=[]), 400, "non-empty"),
    (C(prompt=""), 400, "empty"),
    (C(logit_bias={"999999": 5}), 400, "out of vocabulary"),
    (C(logit_bias={"abc": 5}), 400, "logit_bias"),
    (C(stop_token_ids=[999999]), 400, "out of vocabulary"),
    (C(stream_options={"include_usage": True}), 400, "stream_options"),
    (C(suffix="tail"), 400, "suffix"),
    (CHAT(messages=[]), 400, "messages"),
    (CHAT(messages="hi"), 400, "messages"),
    (CHAT(messages=[{"content": "hi"}]), 400, "role"),
    (
        CHAT(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages",
    ),
    (CHAT(top_logprobs=2), 400, "top_logprobs needs logprobs"),
    (CHAT(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    (CHAT(max_completion_tokens=MAX_MODEL_LEN), 400, "maximum context length"),
    (CHAT(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT(model="gpt-4"), 404, "does not exist"),
    (("/detokenize", {"tokens": [999999]}), 400, "out of vocabulary"),
    # structured outputs: typed, and compiled (parsed) before admission; before, a wrong
    # type killed the engine core's input thread (every later request hung, /health 200)
    (C(structured_outputs={"regex": 123}), 400, "regex"),
    (C(structured_outputs={"json_object": 0}), 400, "json_object"),
    (C(structured_outputs={"choice": "abc"}), 400, "choice"),
    (C(structured_outputs={"grammar": {"a": 1}}), 400, "grammar"),
    (C(structured_outputs={"json": 5}), 400, "json"),
    (C(structured_outputs={"regex": "a", "bogus": 1}), 400, "bogus"),
    (C(structured_outputs={}), 400, "exactly one"),
    (C(structured_outputs={"regex": "[a-"}), 400, "invalid regex"),
    (C(structured_outputs={"grammar": 'root ::= "x'}), 400, "invalid grammar"),
    (C(structured_outputs={"json": {"type": 5}}), 400, "invalid JSON schema"),
    (C(guided_regex=5), 400, "guided_regex"),
    (C(guided_choice="abc"), 400, "guided_choice"),
    (C(guided_choice=["a", 1]), 400, "guided_choice"),
    (C(guided_json=5), 400, "guided_json"),
    (C(guided_grammar="root ::= ("), 400, "invalid grammar"),
    (C(guided_json=DEEP_SCHEMA), 400, "nested deeper"),
    (CHAT(response_format={"type": "json_schema", "json_schema": "x"}), 400, "json_schema"),
    (CHAT(response_format={"type": "yaml"}), 400, "response_format"),
    (CHAT(response_format="json"), 400, "response_format"),
    # integers beyond 64 bits: before, 2**63..2**64-1 crashed the worker (and the server)
    # and larger ones were a 500 that leaked the request's state
    (C(top_k=2**63), 400, "top_k"),
    (C(top_k=2**70), 400, "top_k"),
    (C(min_tokens=2**64), 400, "min_tokens"),
    (C(n=2**64), 400, "n must be"),
    (C(logit_bias={str(2**64): 1}), 400, "logit_bias"),
    (C(stop_token_ids=[2**64]), 400, "stop_token_ids"),
    (C(prompt=[2**64]), 400, "out of vocabulary"),
    (C(max_tokens=2**64), 400, "maximum context length"),
    (("/tokenize", {}), 400, "prompt or messages"),
    # wrong types in nested fields
    (C(stream=True, stream_options={"include_usage": [1]}), 400, "include_usage"),
    (CHAT(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400, "messages"),
    (CHAT(messages=[{"role": ["user"], "content": "hi"}]), 400, "role"),
    (CHAT(response_format={"type": "json_schema", "json_schema": {"schema": "x"}}), 400, "schema"),
    (C(structured_outputs={"choice": ["a", 1]}), 400, "choice"),
    (C(logit_bias={"7": "big"}), 400, "logit_bias"),
    (C(stop_token_ids=["one"]), 400, "stop_token_ids"),
    # empty and huge collections (default limits: 64 stops, 1024 biases, 256 sequences,
    # 16 x max_model_len characters)
    (C(prompt=[[]]), 400, "non-empty"),
    (C(prompt=[""]), 400, "empty"),
    (C(stop=[f"s{i}" for i in range(65)]), 400, "--max-stop-sequences"),
    (C(stop_token_ids=[1] * 65), 400, "--max-stop-sequences"),
    (C(logit_bias={str(i): 1 for i in range(1025)}), 400, "--max-logit-bias"),
    (C(prompt=[PROMPT] * 257), 400, "--max-num-seqs-per-request"),
    (C(prompt=[[5]] * 3, n=100, temperature=1), 400, "--max-num-seqs-per-request"),
    (C(prompt=[5] * 100_000), 400, f"maximum context length is {MAX_MODEL_LEN}"),
    (CHAT(messages=[{"role": "user", "content": "hi"}] * 10_000), 400, "--max-prompt-chars"),
    (("/detokenize", {"tokens": [5] * 10_000}), 400, "--max-prompt-chars"),
]
TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}


def _check_error(r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"] == TYPES[status]
    assert fragment in error["message"], error["message"]


@pytest.mark.parametrize(
    "route_body,status,fragment",
    BAD_JSON_ROWS,
    ids=[f"{i}-{r[0][0]}" for i, r in enumerate(BAD_JSON_ROWS)],
)
def test_bad_request(server, route_body, status, fragment):
    route, body = route_body
    _check_error(httpx.post(server.url + route, json=body, headers=AUTH), status, fragment)
    _check_still_serving(server)


def _check_still_serving(server) -> None:
    """The same engine process, answering a normal request (a hang is a client timeout)."""
    assert children_of(server.pid) == server.engine_pids
    r = httpx.post(
        server.url + "/v1/completions", json=C(max_tokens=1)[1], headers=AUTH, timeout=30
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "content,ctype,fragment",
    [
        (b'{"prompt": "x", ', "application/json", "Invalid JSON"),
        (b"\xff\xfe", "application/json", "Invalid JSON"),
        (b"[1, 2]", "application/json", "JSON object"),
        (b'{"prompt": "x"}', "text/plain", "Unsupported Media Type"),
        (b'{"prompt": "x"}', "", "Unsupported Media Type"),
        (b'{"prompt": "x", "temperature": NaN}', "application/json", "NaN is not valid JSON"),
        (b'{"prompt": "x", "top_p": -Infinity}', "application/json", "Infinity"),
        (b'{"prompt": "x", "logit_bias": {"7": 1e400}}', "application/json", "logit_bias"),
        (
            b'{"prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "application/json",
            "nested too deeply",
        ),
        (
            b'{"prompt": "x", "a": ' + b'{"b": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
            "application/json",
            "nested too deeply",
        ),
    ],
)
def test_malformed_body(server, content, ctype, fragment):
    r = httpx.post(
        server.url + "/v1/completions", content=content, headers={**AUTH, "content-type": ctype}
    )
    _check_error(r, 400, fragment)
    _check_still_serving(server)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer"},
    ],
)
def test_api_key_required_on_v1(server, headers):
    for method, route in (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ):
        r = httpx.request(
            method, server.url + route, headers=headers, json=C()[1] if method == "POST" else None
        )
        _check_error(r, 401, "Unauthorized")


def test_open_routes_need_no_key(server):
    for route in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + route).status_code == 200, route
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "route,body", [("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [5, 6]})]
)
def test_tokenizer_routes_need_key(server, route, body):
    """Before, anyone could make the server tokenize (or decode) without the key."""
    _check_error(httpx.post(server.url + route, json=body), 401, "Unauthorized")
    assert httpx.post(server.url + route, json=body, headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:80", "localhost.evil.example", "127.0.0.1.nip.io", "[::2]:8000"],
)
def test_foreign_host_refused(server, host):
    """DNS rebinding: a page on evil.example that resolves to 127.0.0.1 sends its own name in
    Host; a loopback-bound server answers only loopback names (--allowed-hosts)."""
    for method, route in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health")):
        r = httpx.request(
            method,
            server.url + route,
            headers={**AUTH, "host": host},
            json=C()[1] if method == "POST" else None,
        )
        _check_error(r, 400, "Invalid Host header")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "[::1]:8000"])
def test_loopback_hosts_served(server, host):
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "host": host})
    assert r.status_code == 200, r.text


def test_models_hide_paths(server, tiny_model_dir):
    """A model served by its path is listed by its folder name (before: the full path, as id
    and root); requests may still name it by the path."""
    path = tiny_model_dir("llama")
    r = httpx.get(server.url + "/v1/models", headers=AUTH)
    assert r.status_code == 200 and str(Path(path).parent) not in r.text, r.text
    assert [m["id"] for m in r.json()["data"]] == [Path(path).name]
    r = httpx.post(
        server.url + "/v1/completions", json=C(model=path, max_tokens=1)[1], headers=AUTH
    )
    assert r.status_code == 200 and path not in r.text, r.text


@pytest.mark.parametrize(
    "body",
    [
        C(stop=[])[1],
        C(stop_token_ids=[])[1],
        C(logit_bias={})[1],
        C(logit_bias={"7": 1, "07": 2})[1],
        C(stop=[f"s{i}" for i in range(64)])[1],
        C(prompt=[[5, 6]] * 3)[1],
    ],
)
def test_edge_collections_accepted(server, body):
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def test_duplicate_request_ids(server):
    """Concurrent requests with the same X-Request-Id are separate engine requests: each gets
    its own complete answer (the id is echoed), none is cut short or left hanging."""
    body = C(max_tokens=8, ignore_eos=True, temperature=0)[1]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server.url, headers={**AUTH, "X-Request-Id": "same-id"}, timeout=60
        ) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(3))
            )

    responses = asyncio.run(run())
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same-id"
        assert r.json()["usage"]["completion_tokens"] == 8
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1  # greedy
    _check_still_serving(server)


def test_500_body_hides_exception_text():
    """Before, a 500 echoed the exception's type and text (paths, internals) to the client."""
    from vserve.entrypoints.openai.errors import error_status

    status, message = error_status(RuntimeError("/home/secret/model.bin: bad magic"))
    assert status == 500 and "secret" not in message and "RuntimeError" not in message


def test_extras_and_unknown_fields_accepted(server):
    body = C(
        max_tokens=3,
        min_tokens=3,
        ignore_eos=True,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        stop_token_ids=[1],
        include_stop_str_in_output=False,
        skip_special_tokens=True,
        logit_bias={"7": 2.0},
        user="u1",
        vendor_specific_field={"x": 1},
        temperature=0.7,
        seed=3,
    )[1]
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_still_serving_after_bad_input(server):
    """Runs after the table: the same engine process, healthy, and answering."""
    assert children_of(server.pid) == server.engine_pids
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT(max_tokens=5)[1], headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_queue_full_gives_503(server):
    """max_num_seqs 1 and a queue of 2: of 6 concurrent long requests, 3 are admitted (one
    running, two waiting) and 3 are refused with 503 + Retry-After."""
    body = C(max_tokens=200, ignore_eos=True, stream=True)[1]

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
            streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(6)]
            responses = await asyncio.gather(*(s.__aenter__() for s in streams))
            statuses = [r.status_code for r in responses]
            for r in responses:
                if r.status_code == 503:
                    await r.aread()
                    assert r.headers["retry-after"] == "1"
                    assert r.json()["error"]["type"] == "ServiceUnavailableError"
            for s in streams:  # closing the admitted streams aborts them
                await s.__aexit__(None, None, None)
            return statuses

    statuses = asyncio.run(run())
    assert sorted(statuses) == [200, 200, 200, 503, 503, 503]
    # the server sees the closed streams within moments; then it admits work again
    deadline = time.monotonic() + 5
    while True:
        r = httpx.post(
            server.url + "/v1/completions", json=C(max_tokens=3)[1], headers=AUTH, timeout=10
        )
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_grammar_with_ignore_eos_finishes(server):
    """Async scheduling (the default): a grammar that ends stops its request
    whatever ignore_eos says; before, the engine core died on the next mask fill."""
    check_grammar_with_ignore_eos(server.url, AUTH)
    _check_still_serving(server)


def check_grammar_with_ignore_eos(url: str, headers: dict) -> None:
    for extra, allowed in (
        ({"guided_choice": ["yes", "no"]}, ("yes", "no")),
        ({"structured_outputs": {"regex": "(ab){1,2}"}}, ("ab", "abab")),
    ):
        body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "temperature": 0, **extra}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] in allowed, choice
