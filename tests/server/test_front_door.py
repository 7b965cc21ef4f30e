"""The front door's bounds, without an engine: the body parser refuses what would cost time or
memory before parsing (too many JSON values), reads what Python's parser would let through
wrongly (lone surrogates, NaN) as 400, drops and counts unknown fields; request bodies that
arrive too slowly get 408 and large bodies share a byte budget while they arrive; the Host
check stays on when the server listens on every interface; an empty API key is refused."""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace

import pytest

from vserve.entrypoints.openai.cli import _check_api_keys
from vserve.entrypoints.openai.errors import MAX_BODY_STRUCTURE, APIError, parse_json_body
from vserve.entrypoints.openai.limits import AdmissionLimits
from vserve.entrypoints.openai.middleware import FREE_BODY_BYTES, FrontDoor, host_policy
from vserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vserve.sampling_params import SamplingParams


def _status(body: bytes, model=CompletionRequest) -> tuple[int, str]:
    with pytest.raises(APIError) as info:
        parse_json_body(body, model)
    return info.value.status, info.value.message


@pytest.mark.parametrize(
    "body, fragment",
    [
        (json.dumps({"messages": [{"role": "a"}] * (MAX_BODY_STRUCTURE + 1)}), "JSON objects"),
        (json.dumps({"prompt": [[0]] * (MAX_BODY_STRUCTURE + 1)}), "JSON objects"),
        ('{"prompt": "ab\\ud800cd", "max_tokens": 1}', "surrogate"),
        ('{"prompt": "x", "temperature": NaN}', "NaN is not valid JSON"),
        ('{"prompt": "x", "top_p": -Infinity}', "Infinity"),
        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_body_refused_before_validation(body, fragment):
    status, message = _status(body.encode())
    assert status == 400 and fragment in message, message


def test_unknown_fields_are_dropped_and_reported():
    body = {"prompt": "x", "max_tokens": 1, **{f"k{i}": 0 for i in range(1000)}}
    req, ignored = parse_json_body(json.dumps(body).encode(), CompletionRequest)
    assert len(ignored) == 1000 and not req.model_extra
    assert req.prompt == "x"


def test_numbers_beyond_64_bits_reach_their_field_check():
    """msgspec refuses them without naming the field; Python's parser reads them (an inf, a
    big int), and the field's own check then says which value is wrong."""
    req, _ = parse_json_body(b'{"prompt": "x", "logit_bias": {"7": 1e400}}', CompletionRequest)
    assert req.logit_bias == {"7": float("inf")}
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={7: req.logit_bias["7"]})


def test_chat_body_of_many_small_messages_is_cheap_to_refuse():
    body = json.dumps({"messages": [{"role": "a"}] * 300_000}).encode()
    status, _ = _status(body, ChatCompletionRequest)
    assert status == 400


# -- the Host check ------------------------------------------------------------------------------
def test_host_check_stays_on_for_every_interface():
    policy = host_policy("0.0.0.0", None)
    assert not policy.allows("evil.example") and not policy.allows("evil.example:8000")
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "10.1.2.3:8000", "[fe80::1]"):
        assert policy.allows(host), host
    assert policy.allows(socket.gethostname())
    assert policy.allows(None)  # no Host header: no browser sent it


def test_host_check_on_loopback_and_by_flag():
    loopback = host_policy("127.0.0.1", None)
    assert loopback.allows("localhost:8000") and not loopback.allows("evil.example")
    assert loopback.allows("127.0.0.2:8000") and loopback.allows("[::1]")
    assert not loopback.allows("[::2]:8000") and not loopback.allows("10.1.2.3")
    assert host_policy("0.0.0.0", ["*"]).allows("evil.example")
    named = host_policy("0.0.0.0", ["api.example"])
    assert named.allows("API.example:443") and not named.allows("evil.example")


def test_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        _check_api_keys([""])
    _check_api_keys(["secret"])
    _check_api_keys(None)


# -- bodies on the way in --------------------------------------------------------------------------
def _door(**limits) -> FrontDoor:
    async def app(scope, receive, send):  # reads the whole body, as the handlers do
        while True:
            message = await receive()
            if not message.get("more_body"):
                return

    ctx = SimpleNamespace(limits=AdmissionLimits(**limits), draining=False)
    return FrontDoor(app, ctx)


def _scope() -> dict:
    return {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}


def _receiver(chunks: list[bytes], stall: bool):
    """A client that sends `chunks`, then waits for ever (`stall`) or ends the body."""
    queue = list(chunks)

    async def receive():
        if queue:
            return {"type": "http.request", "body": queue.pop(0), "more_body": True}
        if stall:
            await asyncio.Event().wait()
        return {"type": "http.request", "body": b"", "more_body": False}

    return receive


async def _send(message) -> None:
    pass


def test_slow_body_gets_408():
    async def run():
        door = _door(request_body_timeout=0.2)
        with pytest.raises(APIError) as info:
            await door(_scope(), _receiver([b"x" * 1000], stall=True), _send)
        assert info.value.status == 408 and "--request-body-timeout" in info.value.message
        assert door.pending_bytes == 0

    asyncio.run(run())


def test_large_bodies_share_a_budget_small_ones_are_free():
    async def run():
        # the stalled body holds its share for a second, then times out and gives it back
        door = _door(max_pending_body_bytes=100_000, request_body_timeout=1)
        big = b"x" * (FREE_BODY_BYTES + 90_000)
        stalled = asyncio.ensure_future(door(_scope(), _receiver([big], stall=True), _send))
        await asyncio.sleep(0.05)
        assert door.pending_bytes == 90_000
        with pytest.raises(APIError) as info:  # would take the budget past its limit
            await door(_scope(), _receiver([big], stall=False), _send)
        assert info.value.status == 503 and "--max-pending-body-bytes" in info.value.message
        small = b"x" * (FREE_BODY_BYTES - 1)
        await door(_scope(), _receiver([small], stall=False), _send)  # never refused
        with pytest.raises(APIError):  # the stalled one times out and gives its share back
            await stalled
        assert door.pending_bytes == 0
        await door(_scope(), _receiver([big], stall=False), _send)

    asyncio.run(run())


def test_a_received_body_counts_until_it_is_parsed():
    """A body that has arrived whole still holds its share while it waits to be parsed (a
    queue of parses is memory too); the parser's release gives it back."""

    async def run():
        parsed = asyncio.Event()
        seen = {}

        async def app(scope, receive, send):
            while (await receive()).get("more_body"):
                pass
            seen["budget"] = scope["state"]["body_budget"]
            await parsed.wait()  # the parse is queued
            seen["budget"].release()

        ctx = SimpleNamespace(limits=AdmissionLimits(), draining=False)
        door = FrontDoor(app, ctx)
        big = b"x" * (FREE_BODY_BYTES + 1000)
        task = asyncio.ensure_future(door(_scope(), _receiver([big], stall=False), _send))
        await asyncio.sleep(0.05)
        assert door.pending_bytes == 1000
        parsed.set()
        await task
        assert door.pending_bytes == 0

    asyncio.run(run())


def test_limits_are_validated():
    for bad in (
        dict(max_pending_body_bytes=0),
        dict(request_body_timeout=0),
        dict(max_response_logprobs=0),
        dict(max_request_chars=0),
        dict(max_connections=0),
    ):
        with pytest.raises(ValueError):
            AdmissionLimits(**bad)
