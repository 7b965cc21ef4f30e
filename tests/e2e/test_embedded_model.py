"""The embedded default model: the pretrained Gemma-3-270M, converted once from its GGUF."""

import pytest
import torch

from tests.support.hf_reference import hf_model
from vserve import SamplingParams
from vserve.models.resolve import cache_root, embedded_model_path, resolve_model_path

# transformers, fp32, greedy, "The capital of France is" (with BOS); bf16 and llama.cpp agree
REFERENCE_IDS = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(embedded_fp32):
    """The default: the GGUF's own blocks (fp32 activations); shared with
    test_quantized_model (tests/e2e/conftest.py)."""
    return embedded_fp32(None)


@pytest.fixture(scope="module")
def dequantized_llm(embedded_fp32):
    """Exact fp32 numerics: the GGUF dequantized at load, as transformers loads it (the
    quantized kernels round decode activations to int8 per block, as llama.cpp does)."""
    return embedded_fp32("none")


def test_default_and_alias_resolve_to_embedded():
    path = str(embedded_model_path())
    assert resolve_model_path(None) == path
    assert resolve_model_path("gemma-3-270m") == path
    assert path.startswith(str(cache_root()))


def test_cache_root_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "vserve" / "models"


def test_capital_of_france(llm):
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=11), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == REFERENCE_IDS
    assert out.outputs[0].text == " the capital of the country of France. It is the"


def test_capital_of_france_tensor_parallel():
    """The default path at TP=2: the GGUF's blocks split over two ranks (K-quant inputs of o
    and down by whole blocks of 256, the one KV head on both), in the default dtype (bf16
    where the CPU has it: the fused per-layer calls on each rank's shard). The reference ids;
    in fp32 the first 24 tokens and their logprobs equal one rank's; in bf16 the runs part
    at token 12, a near tie (fp32 gap 0.014) where dense bf16 TP=2 parts too."""
    from vserve import LLM

    llm = LLM(tensor_parallel_size=2, max_model_len=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=len(REFERENCE_IDS))
        out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == REFERENCE_IDS


def test_greedy_equals_transformers(dequantized_llm):
    llm = dequantized_llm
    hf = hf_model(str(embedded_model_path()), torch.float32)
    tok = llm.get_tokenizer()
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt


def test_shipped_chat_template(llm):
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    out = llm.chat(
        [{"role": "user", "content": "Hi"}],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )[0]
    assert out.prompt_token_ids[:2] == [2, 105]  # <bos><start_of_turn>
    assert 106 in llm.config.model.eos_token_ids  # <end_of_turn> stops a chat reply
