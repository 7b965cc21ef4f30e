"""The embedded model on its own GGUF blocks (the default), against the same weights
dequantized to fp32 (`quantization="none"`), and with Q8_0 weights made at load ("int8"):
greedy ids, and the log-likelihood of a fixed 1k-token text from prompt logprobs. The fp32
engines are the ones test_embedded_model uses (tests/e2e/conftest.py)."""

import inspect
import math
import textwrap

import pytest

from tests.support.engines import make_llm
from vserve import SamplingParams
from vserve.models.quant_linear import QuantLinear

pytestmark = pytest.mark.slow

TEXT_TOKENS = 1024
# transformers, fp32, greedy, "The capital of France is" (tests/e2e/test_embedded_model.py)
REFERENCE_IDS = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506]


def _text_ids(tokenizer) -> list[int]:
    """A fixed text: the source of the standard library's textwrap (prose and code)."""
    ids = tokenizer(inspect.getsource(textwrap)).input_ids
    assert len(ids) >= TEXT_TOKENS
    return ids[:TEXT_TOKENS]


def _token_logprobs(llm, ids: list[int]) -> list[float]:
    """The prompt logprob of each token of `ids` after the first."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    lps = out.prompt_logprobs
    return [lps[i][ids[i]].logprob for i in range(1, len(ids))]


def _greedy(llm, quantized: bool) -> list[int]:
    runner = llm.engine.client.core.executor.worker.runner
    linears = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert bool(linears) == quantized
    params = SamplingParams(temperature=0, max_tokens=len(REFERENCE_IDS))
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _run(quantization: str, dtype: str) -> tuple[list[int], float]:
    llm = make_llm(
        None,
        quantization=quantization,
        dtype=dtype,
        max_model_len=TEXT_TOKENS + 16,
        max_num_batched_tokens=512,
    )
    try:
        ids = _greedy(llm, quantized=True)
        return ids, sum(_token_logprobs(llm, _text_ids(llm.get_tokenizer())))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def dequantized(embedded_fp32):
    """Greedy ids and per-token prompt logprobs of the whole text, fp32 on the dequantized
    weights (the engine tests/e2e/conftest.py shares with test_embedded_model)."""
    llm = embedded_fp32("none")
    return _greedy(llm, quantized=False), _token_logprobs(llm, _text_ids(llm.get_tokenizer()))


def test_gguf_native_is_the_same_model(embedded_fp32, dequantized):
    """The default engine (the GGUF's blocks, fp32): the same greedy ids, and the same
    logprob for every token of the text (two prefill chunks, the second on the first's
    KV)."""
    llm = embedded_fp32(None)
    ids = _greedy(llm, quantized=True)
    lps = _token_logprobs(llm, _text_ids(llm.get_tokenizer()))
    ref_ids, ref_lps = dequantized
    assert ref_ids == REFERENCE_IDS
    assert ids == ref_ids
    # token by token: fp32 activations take the kernels' exact path (fp32 sums of the same
    # dequantized weights, in another order), so each logprob agrees to fp32 rounding
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True))
    print("gguf fp32 vs dequantized fp32, max |logprob difference|:", worst)
    assert len(lps) == TEXT_TOKENS - 1 and worst < 1e-3


def test_gguf_native_default_bf16(dequantized):
    ids, ll = _run("gguf", "bfloat16")
    ref_ids, ref_lps = dequantized
    assert ids == ref_ids
    print("log-likelihood gguf bf16 / dequantized fp32:", ll, sum(ref_lps))
    assert math.isclose(ll, sum(ref_lps), rel_tol=0.005)


def test_int8_within_one_percent(dequantized):
    _, ll = _run("int8", "float32")
    print("log-likelihood int8 fp32 / dequantized fp32:", ll, sum(dequantized[1]))
    assert math.isclose(ll, sum(dequantized[1]), rel_tol=0.01)
