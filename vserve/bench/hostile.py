"""Hostile HTTP requests against `vserve serve`, and a probe that measures what each one does
to a live server.

The catalogue (`CATALOGUE`, by name in `ENTRIES`) holds requests that a client may send to
make the server spend memory or time out of proportion: constraints too large or too costly
to compile, bodies of millions of JSON values, strings nested 50000 deep, echo and logprobs
multiplied by `n`, uploads that stall, streams nobody reads, a foreign `Host`. Each entry says
how to send it (a JSON body built lazily, since some are ~32 MiB; raw bytes for malformed
bodies; or a special client: stalled uploads, clients that disconnect, a stream left unread),
the status the server should answer, and the bounds that go with it (time, memory).

`hostile_probe.probe(url, entry)` sends one entry (with the clients of `hostile_clients.py`)
while it samples the RSS of every process of the server's tree and polls `/health`.

Used by `benchmarks/hostile.py` (the table), `benchmarks/soak.py --hostile-mix` (the cheap
entries, repeated) and the server tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
MAX_BODY_BYTES = 32 * MIB  # the server's default --max-request-body-bytes
PROMPT_CHARS = 131_000  # just under the default --max-prompt-chars (16 x 8192) on CPU
# "(a|b)" x 10000: 50 kB, far under the constraint cap, but about 20 s to compile against the
# embedded model's 262k-token vocabulary on a 2-core Xeon (8000: 15 s, 6000: 6.6 s), twice
# the default --grammar-compile-timeout of 10 s
COMPILE_HEAVY_UNITS = 10_000
ABANDONED_UNITS = 8_000  # each abandoned compile: about 15 s on the same machine
ORDINARY = {"prompt": "Hello", "max_tokens": 4}
ORDINARY_ROUTE = "/v1/completions"
CLOSED = "closed"  # an outcome: the server closed the connection without an answer
# bounds for every entry (an entry's own are kept where stricter): the worst /health wait
# while a request runs, and the peak RSS growth of the engine core and the front end
HEALTH_MS = 1000.0
GROWTH_MB = {"engine_core": 256.0, "frontend": 512.0}

Body = Callable[[], bytes]


# -- the catalogue ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One hostile request and what the server should do with it.

    `mode` picks the client: "send" (one request), "abandon" (`abandoned` bodies sent by
    clients that disconnect after 1 s, then `body`), "parallel" (`body` while small requests
    run beside it), "stall" (`stall_count` uploads that stop after `stall_bytes`), "slow_reader"
    (a stream not read for a while). `expect` lists the accepted outcomes (HTTP statuses, or
    CLOSED). Bounds left as None are not checked."""

    name: str
    route: str
    expect: tuple[int | str, ...]
    description: str
    body: Body | None = None
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
    mode: str = "send"
    max_seconds: float | None = None  # the answer's time
    health_ms: float | None = None  # the worst /health wait during the request
    growth_mb: tuple[tuple[str, float], ...] = ()  # (role, MB): peak RSS over the start
    after_mb: tuple[tuple[str, float], ...] = ()  # (role, MB): end RSS over the start
    log_line_max: int | None = None  # bytes of the longest new server log line
    server_flags: tuple[str, ...] = ()  # needs a server started with these flags
    repeatable: bool = True  # cheap enough to repeat in a soak
    abandoned: Callable[[], list[bytes]] | None = None
    stall_count: int = 0
    stall_bytes: int = 0
    stall_declared: int = MAX_BODY_BYTES
    stall_require: int | None = None  # a status that at least one stalled upload must get

    @property
    def expect_label(self) -> str:
        return "/".join(str(s) for s in self.expect)

    def accepts(self, status: int | str) -> bool:
        """Whether `status` is one of the outcomes this entry expects."""
        return status in self.expect

    def request(self) -> tuple[str, str, bytes, dict[str, str]]:
        """(method, route, body, headers) of a plain entry (mode "send")."""
        return self.method, self.route, self.body() if self.body else b"", dict(self.headers)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _lazy(build: Callable[[], Any]) -> Body:
    return lambda: _json(build())


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def compile_heavy_regex(units: int = COMPILE_HEAVY_UNITS) -> str:
    """A regex far under the size cap that is slow to compile against a large vocabulary;
    its random literal tail makes every call a new constraint (no compile cache helps)."""
    return "(a|b)" * units + f"c{random.randrange(10**9)}"


def _schema_body(description_chars: int) -> dict:
    schema = {"type": "object", "description": "A" * description_chars}
    return {
        "prompt": [[1000], [1001]],
        "n": 64,
        "temperature": 1,
        "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def _echo_logprobs(n: int) -> dict:
    return {
        "prompt": [[1000] * 1000, [1001] * 1000],
        "echo": True,
        "logprobs": 20,
        "prompt_logprobs": 20,
        "n": n,
        "temperature": 1,
        "max_tokens": 1,
    }


def _many_messages(body_bytes: int = MAX_BODY_BYTES) -> bytes:
    """`{"messages":[{"role":"a"},...]}` as long as fits under `body_bytes`."""
    one = b'{"role":"a"}'
    count = (body_bytes - len(b'{"messages":[]}') + 1) // (len(one) + 1)
    return b'{"messages":[' + b",".join([one] * count) + b"]}"


def _many_id_lists(body_bytes: int = MAX_BODY_BYTES) -> bytes:
    """`{"prompt":[[0],[0],...]}` as long as fits under `body_bytes` (~8 M lists)."""
    count = (body_bytes - len(b'{"prompt":[]}') + 1) // len(b"[0],")
    return b'{"prompt":[' + b",".join([b"[0]"] * count) + b"]}"


def _long_prompt(chars: int) -> str:
    words = "the quick brown fox jumps over a lazy dog near seven green river stones "
    return (words * (chars // len(words) + 1))[:chars]


def _many_prompts(count: int = 255, chars: int = PROMPT_CHARS) -> bytes:
    prompt = _json(_long_prompt(chars))
    return b'{"max_tokens":1,"prompt":[' + b",".join([prompt] * count) + b"]}"


def _tool_args_nested() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _nested(50000)}}
    return {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 1,
    }


def _unknown_keys(count: int = 100_000) -> dict:
    body: dict[str, Any] = {f"k{i}": 0 for i in range(count)}
    body.update(prompt="Hello", max_tokens=1)
    return body


def _abandoned_regexes() -> list[bytes]:
    return [
        _json({"prompt": "x", "max_tokens": 1, "structured_outputs": {"regex": rx}})
        for rx in (compile_heavy_regex(ABANDONED_UNITS) for _ in range(4))
    ]


C, CHAT = "/v1/completions", "/v1/chat/completions"
ENGINE_64MB = (("engine_core", 64.0),)

CATALOGUE: tuple[Entry, ...] = (
    Entry(
        "regex_1p2mb",
        C,
        (400,),
        "a 1.2 MB regex (a|b) x 200000: over --max-constraint-chars",
        _lazy(
            lambda: {
                "prompt": "x",
                "max_tokens": 1,
                "structured_outputs": {"regex": "(a|b)" * 200000},
            }
        ),
        repeatable=False,  # cheap once refused, but a server without the cap grows to GBs
    ),
    Entry(
        "regex_compile_heavy",
        C,
        (400,),
        "a 50 kB regex under the size cap that compiles for ~20 s: over the compile budget",
        _lazy(
            lambda: {
                "prompt": "x",
                "max_tokens": 1,
                "structured_outputs": {"regex": compile_heavy_regex()},
            }
        ),
        repeatable=False,
    ),
    Entry(
        "chat_2p5m_messages",
        CHAT,
        (400,),
        "~2.6 M {'role':'a'} messages in a body just under 32 MiB: too many JSON values",
        _many_messages,
        max_seconds=5.0,
        repeatable=False,
    ),
    Entry(
        "prompt_8m_lists",
        C,
        (400,),
        "~8.4 M one-id prompt lists in a body just under 32 MiB: too many JSON values",
        _many_id_lists,
        max_seconds=5.0,
        repeatable=False,
    ),
    Entry(
        "guided_json_nested_string",
        C,
        (400,),
        "guided_json as a string nested 50000 deep",
        _lazy(lambda: {"prompt": "x", "max_tokens": 1, "guided_json": _nested(50000)}),
    ),
    Entry(
        "so_json_nested_string",
        C,
        (400,),
        "structured_outputs.json as a string nested 50000 deep",
        _lazy(
            lambda: {"prompt": "x", "max_tokens": 1, "structured_outputs": {"json": _nested(50000)}}
        ),
    ),
    Entry(
        "tool_args_nested_string",
        CHAT,
        (400,),
        "an assistant tool call whose arguments string nests 50000 deep",
        _lazy(_tool_args_nested),
    ),
    Entry(
        "lone_surrogate",
        C,
        (400,),
        "a prompt with a lone surrogate (the JSON escape \\ud800)",
        lambda: b'{"prompt":"ab\\ud800cd","max_tokens":1}',
    ),
    Entry(
        "schema_1mb_n64",
        C,
        (400,),
        "a 1 MB JSON schema x 2 prompts x n=64: over --max-constraint-chars",
        _lazy(lambda: _schema_body(1_000_000)),
    ),
    Entry(
        "schema_200k_n64",
        C,
        (200,),
        "a 200 kB JSON schema x 2 prompts x n=64: one shared constraint, not 128 copies",
        _lazy(lambda: _schema_body(200_000)),
        growth_mb=ENGINE_64MB,
    ),
    Entry(
        "template_kwargs_bos",
        CHAT,
        (400,),
        "chat_template_kwargs.bos_token of 4 M characters: refused before tokenization",
        _lazy(
            lambda: {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "chat_template_kwargs": {"bos_token": "a " * 2_000_000},
            }
        ),
        max_seconds=0.5,
    ),
    Entry(
        "echo_logprobs_n16",
        C,
        (400,),
        "echo + logprobs 20 + prompt_logprobs 20, 2 x 1000 ids, n=16: over --max-response-logprobs",
        _lazy(lambda: _echo_logprobs(16)),
        repeatable=False,
    ),
    Entry(
        "echo_logprobs_n8",
        C,
        (200,),
        "the same with n=8 (672k logprob entries, under the cap)",
        _lazy(lambda: _echo_logprobs(8)),
        health_ms=1000.0,
        repeatable=False,
    ),
    Entry(
        "echo_logprobs_n4",
        C,
        (200,),
        "the same with n=4",
        _lazy(lambda: _echo_logprobs(4)),
        health_ms=1000.0,
    ),
    Entry(
        "echo_only_n128",
        C,
        (200,),
        "echo-only (max_tokens 0), 2 x 8000 ids, n=128: 256 prompt decodes off the event loop",
        _lazy(
            lambda: {
                "prompt": [[1000] * 8000, [1001] * 8000],
                "echo": True,
                "max_tokens": 0,
                "n": 128,
                "temperature": 1,
            }
        ),
        health_ms=1000.0,
        repeatable=False,
    ),
    Entry(
        "abandoned_compiles",
        C,
        (200,),
        "4 compile-heavy regexes whose clients leave after 1 s, then a json_object request",
        _lazy(lambda: {"prompt": "x", "max_tokens": 8, "response_format": {"type": "json_object"}}),
        mode="abandon",
        max_seconds=5.0,
        abandoned=_abandoned_regexes,
        repeatable=False,
    ),
    Entry(
        "many_prompts_chars",
        C,
        (400,),
        "255 prompts of 131000 characters (33 MB): over --max-request-chars, small requests unhurt",
        _many_prompts,
        mode="parallel",
        max_seconds=5.0,
        repeatable=False,
    ),
    Entry(
        "stalled_uploads",
        C,
        (408, 503, CLOSED),
        "20 uploads declaring 32 MiB that stall after 1 MiB: closed by --request-body-timeout",
        mode="stall",
        after_mb=(("frontend", 50.0),),
        stall_count=20,
        stall_bytes=MIB,
        repeatable=False,
    ),
    Entry(
        "pending_body_cap",
        C,
        (408, 503, CLOSED),
        "5 uploads declaring 32 MiB that stall after 30 MiB: over --max-pending-body-bytes, 503",
        mode="stall",
        after_mb=(("frontend", 50.0),),
        stall_count=5,
        stall_bytes=30 * MIB,
        stall_require=503,
        repeatable=False,
    ),
    Entry(
        "unknown_keys_100k",
        C,
        (200,),
        "100000 unknown top-level keys beside a valid prompt: ignored, no log line over 1 KB",
        _lazy(_unknown_keys),
        log_line_max=1024,
    ),
    Entry(
        "unknown_keys_200k",
        C,
        (400,),
        "200000 unknown top-level keys: more JSON values than a body may hold, refused unparsed",
        _lazy(lambda: _unknown_keys(200_000)),
        max_seconds=1.0,
        log_line_max=1024,
    ),
    Entry(
        "temperature_1e39",
        C,
        (400,),
        "temperature 1e39: finite in float64, inf in float32",
        _lazy(lambda: {"prompt": "x", "max_tokens": 1, "temperature": 1e39}),
    ),
    Entry(
        "repetition_penalty_1e-46",
        C,
        (400,),
        "repetition_penalty 1e-46: 0 in float32",
        _lazy(lambda: {"prompt": "x", "max_tokens": 1, "repetition_penalty": 1e-46}),
    ),
    Entry(
        "host_evil",
        "/v1/models",
        (400,),
        "GET /v1/models with Host: evil.example (DNS rebinding), the server on --host 0.0.0.0",
        method="GET",
        headers=(("host", "evil.example"),),
        server_flags=("--host", "0.0.0.0"),
    ),
    Entry(
        "slow_stream_reader",
        C,
        (200,),
        "a stream of n=16 x 256 tokens left unread for 20 s, then read: it completes",
        _lazy(
            lambda: {
                "prompt": "x",
                "stream": True,
                "n": 16,
                "temperature": 1,
                "max_tokens": 256,
                "ignore_eos": True,
            }
        ),
        mode="slow_reader",
        repeatable=False,
    ),
)
ENTRIES: dict[str, Entry] = {e.name: e for e in CATALOGUE}


def repeatable_entries() -> list[Entry]:
    """Plain entries cheap enough to repeat (no 32 MiB bodies, stalls or compile budgets)."""
    return [e for e in CATALOGUE if e.repeatable and e.mode == "send" and not e.server_flags]
