"""A request's sampling parameters reach the sampler: the first token sampled through
`LLM.generate` and through the server follows softmax(logits / T) of transformers' own logits,
after top-k, top-p and min-p, at T = 0.5, 1 and 2 (a chi-square test at significance 0.001,
tests/support/distribution.py).

The draws are seeded, so the tests cannot flake. `test_the_check_catches_an_engine_that_
ignores_temperature` shows the power: the engine's own draws at T = 1 are rejected as draws at
T = 0.5 or 2, so an engine that sampled every request at T = 1 fails here.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.support.distribution import chi_square_ok, reference_probs
from tests.support.engines import make_llm
from vserve import SamplingParams

pytestmark = pytest.mark.slow

PROMPT_TEXT = "The capital of France is"  # ASCII: the reply's text starts clean
DRAWS = 1200
CASES = [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=2.0),
    dict(temperature=1.0, top_k=20),
    dict(temperature=2.0, top_p=0.8),
    dict(temperature=0.7, min_p=0.05),
    dict(temperature=1.5, top_k=50, top_p=0.9, min_p=0.02),
]
IDS = [",".join(f"{k}={v}" for k, v in c.items()) for c in CASES]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(PROMPT_TEXT).input_ids


@pytest.fixture(scope="module")
def hf_logits(model, prompt):
    """transformers' next-token logits after the prompt, fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


@pytest.fixture(scope="module")
def llm(model):
    llm = make_llm(model, max_model_len=64, max_num_seqs=256)
    yield llm
    llm.shutdown()


def engine_draws(llm, prompt: list[int], params: dict, seed0: int = 0) -> torch.Tensor:
    """DRAWS first tokens, one request each, with seeds seed0.."""
    sps = [SamplingParams(max_tokens=1, seed=seed0 + s, **params) for s in range(DRAWS)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * DRAWS, sps, use_tqdm=False)
    return torch.tensor([o.outputs[0].token_ids[0] for o in outs])


@pytest.mark.parametrize("params", CASES, ids=IDS)
def test_llm_generate_samples_the_requested_distribution(llm, prompt, hf_logits, params):
    tokens = engine_draws(llm, prompt, params, seed0=1000 * CASES.index(params))
    assert chi_square_ok(tokens, reference_probs(hf_logits, **params))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_check_catches_an_engine_that_ignores_temperature(llm, prompt, hf_logits, temperature):
    at_one = engine_draws(llm, prompt, dict(temperature=1.0), seed0=50_000)
    assert chi_square_ok(at_one, reference_probs(hf_logits, 1.0))
    assert not chi_square_ok(at_one, reference_probs(hf_logits, temperature))


def _text(tok, token: int) -> str:
    """The text a completion of this one token after an ASCII prompt shows: its decoded text,
    or '' for a special token and for a text that ends in an unfinished UTF-8 character (the
    detokenizer holds such a text back for bytes that never come)."""
    text = tok.decode([token], skip_special_tokens=True)
    return "" if text.endswith("\ufffd") else text


@pytest.mark.parametrize("params", [CASES[0], CASES[2], CASES[6]], ids=[IDS[0], IDS[2], IDS[6]])
def test_the_server_samples_the_requested_distribution(
    tiny_llama_server, model, prompt, hf_logits, params
):
    """/v1/completions with n = 100 choices (seeds derived from the request's), 12 requests,
    to the session's tiny llama server (`model`, fp32): the choices' texts against the
    reference mass of the tokens with each text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [_text(tok, i) for i in range(hf_logits.numel())]
    bins = {t: i for i, t in enumerate(dict.fromkeys(texts))}
    probs = torch.zeros(len(bins), dtype=torch.float64)
    index = torch.tensor([bins[t] for t in texts])
    probs.index_add_(0, index, reference_probs(hf_logits, **params))

    drawn = []
    srv = tiny_llama_server
    assert srv.model_dir == model
    with httpx.Client(timeout=120) as client:
        for r in range(DRAWS // 100):
            # child i of seed s draws with a seed made from s + i (vLLM's s + i): seeds 1000
            # apart keep the requests' children distinct
            body = {"prompt": prompt, "max_tokens": 1, "n": 100, "seed": 1000 * r, **params}
            reply = client.post(srv.url + "/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            drawn += [bins[c["text"]] for c in reply.json()["choices"]]
    assert len(drawn) == DRAWS
    assert chi_square_ok(torch.tensor(drawn), probs)
