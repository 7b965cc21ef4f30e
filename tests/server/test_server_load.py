"""Load on the embedded model (`vserve serve` with no model argument): 64 concurrent streaming
clients over two rounds, greedy, distinct prompts. No request fails, every stream is well
formed, a handful of greedy outputs equal the same requests run alone, and every greedy
output equals the same prompt's in the other round, where it arrived at another place in the
batch (round 1 sends round 0's prompts rotated by 16)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support.openai_server import ServerProcess

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

NUM_CLIENTS = 64
NUM_ROUNDS = 2
MAX_TOKENS = 12
NUM_ALONE = 2
SUBJECTS = [
    "the ocean",
    "a violin",
    "Mount Everest",
    "bread",
    "the moon",
    "a library",
    "volcanoes",
    "chess",
    "honeybees",
    "the Roman Empire",
    "rain",
    "a lighthouse",
    "glaciers",
    "jazz",
    "the desert",
    "a bicycle",
]
STYLES = ["Write one sentence about", "Give a fun fact about", "Describe", "Explain briefly"]


def _prompt(round_idx: int, i: int) -> str:
    subject = SUBJECTS[i % len(SUBJECTS)]
    style = STYLES[(i // len(SUBJECTS) + round_idx) % len(STYLES)]
    return f"{style} {subject}."


@pytest.fixture(scope="module")
def server():
    # dense fp32: bf16 matmuls round differently for different batch shapes, and quantized
    # weights take a gemv for a few rows and a matmul for more, so a greedy output can depend
    # on what else shares the batch; in dense fp32 it does not
    srv = ServerProcess(
        [
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "64",
            "--dtype",
            "float32",
            "--quantization",
            "none",
        ]
    )
    try:
        yield srv.wait_ready(timeout=300)
    finally:
        assert srv.stop() == 0


async def _chat(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.chat.completions.create(
        model="gemma-3-270m",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, reasons, usage = "", [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert len(reasons) == 1 and reasons[0] in ("stop", "length"), reasons
    assert usage is not None and 1 <= usage.completion_tokens <= MAX_TOKENS
    return text


@pytest.mark.slow
def test_concurrent_streams_equal_alone(server):
    async def run() -> tuple[list[str], list[list[str]]]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300
        )
        alone = [
            await _chat(client, _prompt(r, i)) for r in range(NUM_ROUNDS) for i in range(NUM_ALONE)
        ]
        rounds = []
        for r in range(NUM_ROUNDS):
            prompts = [_prompt(r, i) for i in range(NUM_CLIENTS)]
            assert len(set(prompts)) == NUM_CLIENTS
            rounds.append(await asyncio.gather(*(_chat(client, p) for p in prompts)))
        await client.close()
        return alone, rounds

    alone, rounds = asyncio.run(run())
    for r in range(NUM_ROUNDS):
        for i in range(NUM_ALONE):
            assert rounds[r][i] == alone[r * NUM_ALONE + i], (r, i)
    assert all(text for texts in rounds for text in texts)
    # all 128 streams: each prompt's output in round 1 equals its output in round 0, where it
    # arrived 16 places later among different neighbours
    first = dict(zip((_prompt(0, i) for i in range(NUM_CLIENTS)), rounds[0]))
    assert set(first) == {_prompt(1, i) for i in range(NUM_CLIENTS)}
    for i in range(NUM_CLIENTS):
        assert rounds[1][i] == first[_prompt(1, i)], i
