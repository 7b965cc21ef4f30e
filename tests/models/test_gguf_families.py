"""Dense families whose GGUF files transformers' reader does not know (Granite, OLMo 2,
SmolLM3) or reads in part (Gemma 2's soft-caps, Phi-3's partial rotary and LongRoPE factors),
in files made by llama.cpp's converter and quantizer (tests/fixtures/llamacpp): the config
comes from the file (Granite's four scales; SmolLM3's layers without rotary, every fourth as
llama.cpp's graph fixes it), Q8_0 on its blocks is the file dequantized, and with fp32 weights
vserve's greedy ids are llama.cpp's own (Phi-3 on its short factors: the context, 256, is
within its original 512, as llama-server's was)."""

from __future__ import annotations

import json

import pytest

from tests.models.test_gguf_moe import FIXTURES, _llm, fixture

FAMILIES = ["granite", "olmo2", "smollm3", "gemma2", "phi3"]
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of France"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_config_is_the_files(kind):
    from transformers import AutoConfig

    from vserve.models.resolve import resolve_model_path

    cfg = AutoConfig.from_pretrained(resolve_model_path(str(fixture(f"tiny-{kind}-q8_0.gguf"))))
    assert cfg.model_type == kind and cfg.hidden_size == 64
    if kind == "granite":  # tests/support/tiny_models.py's knobs, through the file's keys
        scales = (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling)
        assert scales == (2.0, 0.5, 1.5) and cfg.attention_multiplier == pytest.approx(0.15)
    if kind == "smollm3":
        assert cfg.no_rope_layers == [1, 1, 1, 0] and cfg.tie_word_embeddings
    if kind == "gemma2":  # the tiny model's caps, not transformers' defaults (50, 30)
        caps = (cfg.attn_logit_softcapping, cfg.final_logit_softcapping)
        assert caps == (5.0, 3.0) and cfg.query_pre_attn_scalar == 32
    if kind == "phi3":
        rope = cfg.rope_parameters
        assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.5
        assert rope["long_factor"] == [1.5, 3.0, 6.0, 12.0]
        assert rope["original_max_position_embeddings"] == 512


def _greedy_and_logprobs(path, quantization: str):
    from vserve import SamplingParams

    llm = _llm(path, quantization)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    lps = [
        [e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs
    ]
    return [list(o.outputs[0].token_ids) for o in outs], lps


@pytest.mark.parametrize("kind", FAMILIES)
def test_q8_0_on_its_blocks_is_the_dequantized_model(kind):
    path = fixture(f"tiny-{kind}-q8_0.gguf")
    ids, lps = _greedy_and_logprobs(path, "gguf")
    ref_ids, ref_lps = _greedy_and_logprobs(path, "none")
    assert ids == ref_ids
    worst = max(abs(a - b) for ra, rb in zip(lps, ref_lps) for a, b in zip(ra, rb))
    assert worst < 1e-4


@pytest.mark.parametrize("kind", FAMILIES)
def test_fp32_greedy_equals_llamacpp(kind):
    from vserve import SamplingParams

    name = f"tiny-{kind}-f32.gguf"
    recorded = json.loads((FIXTURES / "llamacpp_greedy.json").read_text())
    llm = _llm(fixture(name))
    try:
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in recorded["prompts"]]
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == recorded["greedy"][name]
