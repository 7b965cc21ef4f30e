"""A disconnect storm (vLLM's test_request_cancellation, plus non-streaming clients): 200
streaming requests that ask for 10000 tokens each are dropped by their clients at random
points after their first chunk. Every one must be aborted in the engine: /metrics shows no
running or waiting request and an empty KV cache within moments, aborts are counted, and a
new request is served at once."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.support.openai_server import TINY_ARGS, ServerProcess, metric_value

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

NUM_STREAMS = 200
NUM_NON_STREAMING = 20


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    model_dir = tiny_model_dir("llama", max_position_embeddings=16384)
    srv = ServerProcess(
        [model_dir, *TINY_ARGS, "--max-model-len", "10240", "--num-gpu-blocks-override", "4096"]
    )
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0


def _body(i: int, stream: bool) -> tuple[str, dict]:
    long = {"max_tokens": 10000, "min_tokens": 10000, "ignore_eos": True, "stream": stream}
    if i % 2:
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"hi {i}"}],
            **long,
        }
    return "/v1/completions", {"prompt": f"Once upon a time {i}", **long}


async def _storm(url: str) -> list[str]:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=NUM_STREAMS + NUM_NON_STREAMING + 8)

    async def one(client: httpx.AsyncClient, i: int, stream: bool) -> str:
        route, body = _body(i, stream)
        delay = rng.uniform(0.2, 1.0)
        if not stream:  # dropped at any point, maybe before the engine has it
            try:
                await asyncio.wait_for(client.post(route, json=body), timeout=delay)
            except asyncio.TimeoutError:
                return "dropped"
            return "finished"
        async with client.stream("POST", route, json=body) as r:
            chunks = r.aiter_raw()
            await anext(chunks)  # the engine has it: a stream is dropped mid-generation

            async def drain() -> None:
                async for _ in chunks:
                    pass

            try:
                await asyncio.wait_for(drain(), timeout=delay)
            except asyncio.TimeoutError:
                return "dropped"
        return "finished"

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        jobs = [one(client, i, True) for i in range(NUM_STREAMS)]
        jobs += [one(client, i, False) for i in range(NUM_NON_STREAMING)]
        return await asyncio.gather(*jobs)


def _idle_metrics(url: str, timeout: float) -> tuple[float, dict[str, float]]:
    """Seconds until /metrics reads idle (or the timeout), and the last values read."""
    start = time.monotonic()
    names = (
        "vserve:num_requests_running",
        "vserve:num_requests_waiting",
        "vserve:kv_cache_usage_perc",
    )
    while True:
        text = httpx.get(url + "/metrics", timeout=5).text
        values = {name: metric_value(text, name) for name in names}
        elapsed = time.monotonic() - start
        if not any(values.values()) or elapsed > timeout:
            return elapsed, {**values, "aborts": _aborts(text)}
        time.sleep(0.1)


def _aborts(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("vserve:request_success_total{") and 'reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_storm_frees_everything(server):
    outcomes = asyncio.run(_storm(server.url))
    assert outcomes.count("dropped") == len(outcomes)  # 10000 tokens never finish in 1 s
    elapsed, values = _idle_metrics(server.url, timeout=10)
    assert values["vserve:num_requests_running"] == 0, values
    assert values["vserve:num_requests_waiting"] == 0, values
    assert values["vserve:kv_cache_usage_perc"] == 0, values
    assert elapsed < 3, f"metrics took {elapsed:.1f} s to read idle"
    # every stream reached the engine before its client dropped it: each abort is counted
    # (the non-streaming ones may have been dropped before submission)
    assert NUM_STREAMS <= values["aborts"] <= NUM_STREAMS + NUM_NON_STREAMING, values
    start = time.monotonic()
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "The quick brown fox", "max_tokens": 10, "ignore_eos": True},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    assert time.monotonic() - start < 5
    assert httpx.get(server.url + "/health").status_code == 200
