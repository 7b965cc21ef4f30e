"""Fuzzing as a test: schemathesis drives every operation of the server's own
/openapi.json on a tiny model, with bodies that fit the schema and bodies that break it, and
no response is a 5xx (nor a streamed error event with code 500); afterwards the same engine
process still serves a normal request.

Bounded: about 300 cases in all. The test's copy of the schema caps max_tokens at 4 (the
server's --max-model-len of 64 bounds what a schema-breaking case can ask for), so that every
case runs in milliseconds on the CPU.

The cases are derandomized (the same every run), so that a CI failure replays; set
VSERVE_FUZZ_RANDOM=1 to draw new ones (6000 random cases found nothing more on 2026-11-30).
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest

from tests.support.openai_server import TINY_ARGS, children_of, serving

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

# schemathesis's GenerationMode by name: schemathesis and hypothesis (2 s of imports) load in
# the test, not when the suite is collected (pyproject.toml keeps their pytest plugins out)
NUM_CASES = {"POSITIVE": 200, "NEGATIVE": 100}
MAX_TOKENS = {"type": "integer", "minimum": 1, "maximum": 4}
RANDOM = os.environ.get("VSERVE_FUZZ_RANDOM") == "1"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(
        [
            tiny_model_dir("llama"),
            *TINY_ARGS,
            "--max-model-len",
            "64",
            "--max-num-seqs",
            "32",
            "--request-timeout",
            "30",
        ]
    ) as srv:
        yield srv


def _bounded(document: dict) -> dict:
    """The server's document, with max_tokens required and small in generating requests."""
    schemas = document["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field] = MAX_TOKENS
        schemas[name].setdefault("required", []).append("max_tokens")
    return document


def _tracebacks(log: str, num_chars: int = 6000) -> str:
    """The server log's failed requests (their tracebacks), for the failure message."""
    start = log.find("request failed")
    return log[start : start + num_chars] if start >= 0 else log[-num_chars:]


def test_documented_bodies(server):
    """Every POST route documents its JSON body, as a schema the fuzzer can generate from."""
    document = httpx.get(server.url + "/openapi.json").json()
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert set(posts) >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for path, op in posts.items():
        if path == "/ping":
            continue
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in document["components"]["schemas"], path
    props = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "stop", "logit_bias", "structured_outputs"} <= set(props)


def test_fuzz_no_server_errors(server):
    import schemathesis  # the `test` extra of pyproject.toml
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_dict(
        _bounded(httpx.get(server.url + "/openapi.json").json())
    )
    failures: list[str] = []
    statuses: Counter = Counter()
    num_cases = 0

    def one(case) -> None:
        nonlocal num_cases
        num_cases += 1
        try:
            r = case.call(base_url=server.url, timeout=60)
        except Exception as e:  # noqa: BLE001 -- a hang or dropped connection is a failure
            failures.append(f"{case.method} {case.path} {case.body!r:.2000}: {e!r}")
            return
        statuses[case.method, case.path, r.status_code] += 1
        streamed_500 = r.status_code == 200 and '"code": 500' in r.text
        if r.status_code >= 500 or streamed_500:
            failures.append(
                f"{case.method} {case.path} {case.body!r:.2000} -> {r.status_code} {r.text[:300]}"
            )

    for mode, num in NUM_CASES.items():
        run = settings(
            max_examples=num,
            deadline=None,
            database=None,
            derandomize=not RANDOM,  # CI replays one fixed set; VSERVE_FUZZ_RANDOM=1 explores
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(given(case=schema.as_strategy(generation_mode=GenerationMode[mode]))(one))
        run()
    print(f"{num_cases} cases:", dict(sorted(statuses.items())))
    assert num_cases >= 250, num_cases
    assert not failures, (
        f"{len(failures)} of {num_cases} cases failed:\n"
        + "\n".join(failures[:10])
        + "\nthe server's log:\n"
        + _tracebacks(server.log_tail(200_000))
    )
    # the same engine process, still serving
    assert children_of(server.pid) == server.engine_pids
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=30,
        json={"prompt": "The quick brown fox", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
