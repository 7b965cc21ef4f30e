"""Admission limits of `vserve serve`: each limit refuses with its status and
an OpenAI-style error body before any tokenization or engine work, and the engine keeps
serving; a request past --request-timeout ends with finish_reason "abort"; tokenization runs
off the event loop, so /health answers while a long prompt is being tokenized."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.openai_server import TINY_ARGS, children_of, serving

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

MAX_BODY = 100_000
LIMIT_ARGS = [
    "--max-model-len",
    "8192",
    "--max-request-body-bytes",
    str(MAX_BODY),
    "--max-prompt-chars",
    "20000",
    "--max-num-seqs-per-request",
    "8",
    "--max-stop-sequences",
    "4",
    "--max-stop-chars",
    "16",
    "--max-logit-bias",
    "4",
    "--request-timeout",
    "3",
]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    model_dir = tiny_model_dir("llama", max_position_embeddings=8192)
    with serving([model_dir, *TINY_ARGS, *LIMIT_ARGS]) as srv:
        yield srv


def C(**body):
    return "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **body}


def CHAT(**body):
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **body,
    }


LIMIT_ROWS = [
    # (route and body, status, part of the message)
    (C(prompt=[PROMPT] * 3, n=3, temperature=1), 400, "--max-num-seqs-per-request"),
    (C(prompt=[[5, 6]] * 9), 400, "--max-num-seqs-per-request"),
    (C(n=9, temperature=1), 400, "--max-num-seqs-per-request"),
    (CHAT(n=9, temperature=1), 400, "--max-num-seqs-per-request"),
    (C(prompt="x" * 20_001), 400, "--max-prompt-chars"),
    (C(prompt=[PROMPT, "y" * 20_001]), 400, "--max-prompt-chars"),
    (CHAT(messages=[{"role": "user", "content": "z" * 10_000}] * 3), 400, "--max-prompt-chars"),
    (("/tokenize", {"prompt": "x" * 20_001}), 400, "--max-prompt-chars"),
    (("/detokenize", {"tokens": [5] * 20_001}), 400, "--max-prompt-chars"),
    (C(prompt=[5] * 9000), 400, "maximum context length"),
    (C(stop=["a", "b", "c", "d", "e"]), 400, "--max-stop-sequences"),
    (C(stop_token_ids=[1, 2, 3, 4, 5]), 400, "--max-stop-sequences"),
    (C(stop="s" * 17), 400, "--max-stop-chars"),
    (CHAT(stop=["ok", "s" * 17]), 400, "--max-stop-chars"),
    (C(logit_bias={str(i): 1 for i in range(5)}), 400, "--max-logit-bias"),
    (C(prompt="p" * (MAX_BODY + 10)), 413, "--max-request-body-bytes"),
]


@pytest.mark.parametrize(
    "route_body,status,fragment",
    LIMIT_ROWS,
    ids=[f"{i}-{r[0][0]}" for i, r in enumerate(LIMIT_ROWS)],
)
def test_limit_refused(server, route_body, status, fragment):
    route, body = route_body
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and fragment in error["message"], error
    _check_still_serving(server)


def test_within_limits_accepted(server):
    body = C(
        prompt=[PROMPT] * 2,
        n=4,
        temperature=1,
        stop=["a", "b", "c", "d"],
        stop_token_ids=[1, 2, 3, 4],
        logit_bias={str(i): 1 for i in range(4)},
    )[1]
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8


def test_chunked_body_too_large(server):
    """No Content-Length (chunked): the server counts what it receives and stops at the
    limit, instead of reading the whole body into memory."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"q" * 10_000  # 500 kB in all
        yield b'"}'

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413, r.text
    assert "--max-request-body-bytes" in r.json()["error"]["message"]
    _check_still_serving(server)


def test_request_timeout_aborts(server):
    """A request that would run far longer than --request-timeout (3 s) is aborted in the
    engine: it ends with finish_reason "abort", streaming or not, and frees its slot. The two
    requests run side by side (one timeout's wait, not two)."""
    body = C(max_tokens=8000, ignore_eos=True)[1]

    def stream_events() -> list[str]:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120
        ) as s:
            return [line for line in s.iter_lines() if line.startswith("data: {")]

    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(stream_events)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        events = streamed.result(timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert r.json()["usage"]["completion_tokens"] < 8000
    assert '"finish_reason":"abort"' in events[-1], events[-1]
    _check_still_serving(server)


def _check_still_serving(server) -> None:
    """The same engine process, answering a normal request (a hang is a client timeout)."""
    assert children_of(server.pid) == server.engine_pids
    r = httpx.post(server.url + "/v1/completions", json=C(max_tokens=1)[1], timeout=30)
    assert r.status_code == 200, r.text


# -- tokenization off the event loop ------------------------------------------------------------
@pytest.fixture(scope="module")
def big_server(tiny_model_dir):
    with serving(
        [
            tiny_model_dir("llama"),
            *TINY_ARGS,
            "--max-model-len",
            "256",
            "--max-prompt-chars",
            "5000000",
        ]
    ) as srv:
        yield srv


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_health_answers_while_tokenizing(big_server, route):
    """A 4M-character prompt (allowed by --max-prompt-chars) takes seconds to tokenize; /health,
    polled from the moment the prompt is sent, answers early in that time. Before, the
    tokenizer ran on the event loop and the first /health answer came after it. The bound is
    a share of the big request's own duration, so a fast or a loaded machine reads the same."""
    text = "The quick brown fox " * 200_000
    body = (
        {"prompt": text, "max_tokens": 1}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    )

    async def run() -> tuple[float, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=big_server.url, timeout=120) as client:
            start = time.monotonic()
            big = asyncio.create_task(client.post(route, json=body))
            first_health = None
            while not big.done():
                health = await client.get("/health")
                assert health.status_code == 200
                if first_health is None:
                    first_health = time.monotonic() - start
                await asyncio.sleep(0.02)
            response = await big
            return first_health, time.monotonic() - start, response

    first_health, big_time, response = asyncio.run(run())
    assert first_health is not None and first_health < big_time / 3, (
        f"/health first answered after {first_health} s of a {big_time:.2f} s tokenization"
    )
    assert response.status_code == 400 and "maximum context length" in response.text


def test_token_text_cache_is_bounded():
    """Logprob entries name tokens by their text; the cache of those texts keeps the most
    recent ones only (it grew towards the whole vocabulary while a server ran: the soak's
    front end gained ~1.4 KB per request)."""
    from vserve.entrypoints.openai.serving_base import TokenStrings

    calls = []

    class Tokenizer:
        def decode(self, ids):
            calls.append(ids)
            return f"<{ids[0]}>"

    strings = TokenStrings(Tokenizer(), size=100)
    assert [strings(i) for i in range(1000)][:2] == ["<0>", "<1>"]
    assert strings.decode.cache_info().currsize == 100
    strings(999)  # recent: cached
    assert len(calls) == 1000
