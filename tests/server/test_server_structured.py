"""The server with n-gram drafts: response_format json_schema output validates, and the
draft counters show up in /metrics; a grammar with ignore_eos finishes, with drafts and with
async scheduling off."""

import json

import httpx
import pytest

from tests.server.test_server_errors import check_grammar_with_ignore_eos
from tests.support.openai_server import TINY_ARGS, ServerProcess, children_of, metric_value

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(
        [
            tiny_model_dir("gemma3"),
            *TINY_ARGS,
            "--max-model-len",
            "512",
            "--served-model-name",
            "tiny",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
        ]
    ).wait_ready()
    yield srv
    assert srv.stop() == 0


def test_response_format_json_schema(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "give json"}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    for stream in (False, True):
        if stream:
            text = ""
            with httpx.stream(
                "POST",
                server.url + "/v1/chat/completions",
                json={**body, "stream": True},
                timeout=60,
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"]
                        text += "".join(c["delta"].get("content") or "" for c in delta)
        else:
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
        obj = json.loads(text)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 9


def test_response_format_errors(server):
    bad = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=bad, timeout=30)
    assert r.status_code == 400 and "schema" in r.json()["error"]["message"]
    two = {"model": "tiny", "prompt": "x", "guided_regex": "a+", "guided_choice": ["b"]}
    r = httpx.post(server.url + "/v1/completions", json=two, timeout=30)
    assert r.status_code == 400


def test_draft_counters_in_metrics(server):
    body = {
        "model": "tiny",
        "prompt": "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=10).text
    drafts = metric_value(text, "vserve:spec_num_drafts_total")
    proposed = metric_value(text, "vserve:spec_num_draft_tokens_total")
    accepted = metric_value(text, "vserve:spec_num_accepted_tokens_total")
    assert drafts > 0 and 0 <= accepted <= proposed
    assert "vserve:steps_without_overlap_total" in text


def test_grammar_with_ignore_eos_finishes(server):
    pids = children_of(server.pid)
    check_grammar_with_ignore_eos(server.url, {})
    assert children_of(server.pid) == pids


def test_grammar_with_ignore_eos_finishes_sync(tiny_model_dir):
    """A grammar that ends stops its request whatever ignore_eos says, with async scheduling
    off (one step in flight)."""
    srv = ServerProcess(
        [tiny_model_dir("llama"), *TINY_ARGS, "--max-model-len", "256", "--no-async-scheduling"]
    ).wait_ready()
    try:
        pids = children_of(srv.pid)
        check_grammar_with_ignore_eos(srv.url, {})
        assert children_of(srv.pid) == pids
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        assert srv.stop() == 0
