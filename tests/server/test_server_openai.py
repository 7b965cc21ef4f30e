"""The OpenAI-compatible server through the official `openai` client, on a tiny model: request
and response shapes, streaming (deltas add up to the non-streamed text), n, logprobs, usage,
stop strings, and the service routes (/v1/models, /tokenize, /detokenize, /version, /health,
/metrics, X-Request-Id)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.openai_server import TINY_MAX_MODEL_LEN, TINY_NAME

MODEL = TINY_NAME
MAX_MODEL_LEN = TINY_MAX_MODEL_LEN
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    return tiny_llama_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN
    # the card names the model; the server's filesystem stays private
    assert server.model_dir not in httpx.get(server.url + "/v1/models").text


def test_completion_shape_and_usage(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    num_prompt = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == num_prompt
    assert out.usage.total_tokens == num_prompt + 8
    # a token-id prompt is the same request
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert again.choices[0].text == out.choices[0].text


def _stream_text(chunks) -> tuple[str, list[str], list]:
    text, reasons, usage = "", [], []
    for chunk in chunks:
        if chunk.usage is not None:
            usage.append(chunk)
        for c in chunk.choices:
            text += (c.text if hasattr(c, "text") else c.delta.content) or ""
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
    return text, reasons, usage


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text, reasons, usage = _stream_text(chunks)
    assert text == full.choices[0].text
    assert reasons == ["length"]
    assert len(usage) == 1 and usage[0] is chunks[-1] and chunks[-1].choices == []
    assert usage[0].usage.completion_tokens == 12


def test_chat_and_stream(client):
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
    )
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    text, reasons, usage = _stream_text(chunks)
    assert text == msg.content and reasons == [full.choices[0].finish_reason]
    assert usage[0].usage.completion_tokens == full.usage.completion_tokens
    # content as a list of text parts is the same conversation
    parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    same = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, temperature=0)
    assert same.choices[0].message.content == msg.content


def test_n_and_batched_prompts(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    prompts = [PROMPT, "Once upon a time"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    four = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, n=2, temperature=1.0
    )
    assert sorted(c.index for c in four.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=2, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and sampled <= 0
        assert sampled == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_string(client):
    text = (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    # a short ASCII piece from the middle of the greedy text, as a stop string
    start = next(
        i
        for i in range(2, len(text) - 1)
        if text[i : i + 2].isascii()
        and text[i : i + 2].strip() == text[i : i + 2]
        and "\ufffd" not in text[: i + 2]
    )
    stop = text[start : start + 2]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_echo(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)


def test_tokenize_detokenize(server):
    tok = httpx.post(
        server.url + "/tokenize",
        json={"prompt": "hello world", "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    assert len(tok["token_strs"]) == tok["count"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == "hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tok["count"]


def test_service_routes(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_success_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "model_forward_time_seconds_bucket",
        "step_launch_interval_seconds_bucket",
        "scheduler_busy_time_seconds_bucket",
        "scheduler_exposed_time_seconds_bucket",
    ):
        assert f"vserve:{name}{{" in text, name
    labels = f'engine="0",finished_reason="length",model_name="{MODEL}"'
    assert f"vserve:request_success_total{{{labels}}}" in text


def _sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_count_by_value(server, client):
    """The counters move by exactly what the requests did (test audit: names alone were
    checked): prompt and generated tokens as the usage says, one success per request with its
    finish reason, one TTFT and one end-to-end latency observation each, none left running."""
    names = {
        "prompt": ("vserve:prompt_tokens_total", {}),
        "generated": ("vserve:generation_tokens_total", {}),
        "length": ("vserve:request_success_total", {"finished_reason": "length"}),
        "stop": ("vserve:request_success_total", {"finished_reason": "stop"}),
        "ttft": ("vserve:time_to_first_token_seconds_count", {}),
        "e2e": ("vserve:e2e_request_latency_seconds_count", {}),
    }

    def read() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {k: _sum(text, n, **labels) for k, (n, labels) in names.items()}

    before = read()
    prompts, usage = ["one two three", "a much longer prompt of several words", "x"], []
    for i, p in enumerate(prompts):
        out = client.completions.create(model=MODEL, prompt=p, max_tokens=3 + i, temperature=0)
        assert out.choices[0].finish_reason == "length"
        usage.append(out.usage)
    want = {
        "prompt": sum(u.prompt_tokens for u in usage),
        "generated": sum(u.completion_tokens for u in usage),
        "length": 3,
        "stop": 0,
        "ttft": 3,
        "e2e": 3,
    }
    assert want["generated"] == 3 + 4 + 5
    deadline, got = time.monotonic() + 10, {}
    while time.monotonic() < deadline:  # the engine's stats reach the front end each step
        after = read()
        got = {k: after[k] - before[k] for k in names}
        if got == want:
            break
        time.sleep(0.1)
    assert got == want
    text = httpx.get(server.url + "/metrics").text
    assert _sum(text, "vserve:num_requests_running") == 0


def test_request_id_echoed(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "req-42"})
    assert r.headers["x-request-id"] == "req-42" and r.json()["id"] == "cmpl-req-42"
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "req-43"},
    ) as r:
        assert r.headers["x-request-id"] == "req-43"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"id":"chatcmpl-req-43"' in lines[0]
    assert httpx.get(server.url + "/health").headers["x-request-id"]
