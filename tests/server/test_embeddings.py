"""`/v1/embeddings` through the official `openai` client: texts and token ids, float and
base64 (the client's default) alike and equal to `LLM.embed`'s vectors, OpenAI's usage,
embeddings served while a completion streams, and clear 400s for what cannot be served."""

from __future__ import annotations

import base64
import concurrent.futures

import numpy as np
import openai
import pytest

from tests.support.engines import make_llm
from tests.support.openai_server import TINY_MAX_MODEL_LEN
from vserve.entrypoints.openai.limits import AdmissionLimits

pytestmark = pytest.mark.slow  # the session's tiny llama server

MAX_NUM_SEQS_PER_REQUEST = AdmissionLimits().max_num_seqs_per_request  # the server's default
TEXTS = ["The quick brown fox", "Paris is the capital of France", "1 2 3 4"]


@pytest.fixture(scope="module")
def model(tiny_llama_server):
    return tiny_llama_server.model_dir


@pytest.fixture(scope="module")
def client(tiny_llama_server):
    url = tiny_llama_server.url
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model):
    llm = make_llm(model, max_model_len=256)
    try:
        yield {
            "texts": [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)],
            "ids": llm.get_tokenizer()(TEXTS[1])["input_ids"],
        }
    finally:
        llm.shutdown()


def _name(client) -> str:
    return client.models.list().data[0].id


def test_floats_and_base64_equal_the_offline_vectors(client, offline):
    floats = client.embeddings.create(model=_name(client), input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    for d, want in zip(floats.data, offline["texts"]):
        np.testing.assert_allclose(d.embedding, want, rtol=1e-5, atol=1e-6)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    # base64 carries the float32 bits of the same request's floats; against the offline batch
    # of three, the batch-size tolerance above (an fp32 GEMM may round by the rows it has)
    alone = client.embeddings.create(model=_name(client), input=TEXTS[0], encoding_format="float")
    want = np.asarray(alone.data[0].embedding, dtype=np.float32)
    raw = client.embeddings.with_raw_response.create(
        model=_name(client), input=TEXTS[0], encoding_format="base64"
    )
    b64 = raw.http_response.json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    np.testing.assert_array_equal(decoded, want)
    np.testing.assert_allclose(decoded, offline["texts"][0], rtol=1e-5, atol=1e-6)
    default = client.embeddings.create(model=_name(client), input=TEXTS[0])  # base64 on the wire
    np.testing.assert_array_equal(np.asarray(default.data[0].embedding, dtype=np.float32), want)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)


def test_token_ids_as_input(client, offline):
    r = client.embeddings.create(
        model=_name(client), input=[offline["ids"]], encoding_format="float"
    )
    np.testing.assert_allclose(r.data[0].embedding, offline["texts"][1], rtol=1e-5, atol=1e-6)
    assert r.usage.prompt_tokens == len(offline["ids"])


def test_embeddings_beside_a_streaming_completion(client, offline):
    """One engine runs both: a completion streams while embeddings come and go."""

    def complete():
        stream = client.completions.create(
            model=_name(client), prompt="Once upon a time", max_tokens=48, stream=True
        )
        return sum(1 for _ in stream)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(complete)
        for _ in range(3):
            r = client.embeddings.create(model=_name(client), input=TEXTS, encoding_format="float")
            for d, want in zip(r.data, offline["texts"]):
                np.testing.assert_allclose(d.embedding, want, rtol=1e-4, atol=1e-5)
        assert streaming.result(timeout=60) > 1


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input": ""}, "must not be empty"),
        ({"input": [[]]}, "non-empty list"),
        ({"input": "hi", "dimensions": 7}, "have 64 numbers"),
        ({"input": ["x"] * (MAX_NUM_SEQS_PER_REQUEST + 1)}, "--max-num-seqs-per-request"),
        ({"input": [10**6]}, "out of vocabulary"),
        ({"input": "x " * TINY_MAX_MODEL_LEN}, "maximum context length"),
    ],
)
def test_what_cannot_be_served_is_a_400(client, body, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.embeddings.create(model=_name(client), encoding_format="float", **body)
