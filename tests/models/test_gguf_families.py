"""Dense families whose GGUF files transformers' reader does not know (Granite, OLMo 2,
SmolLM3) or reads in part (Gemma 2's soft-caps, Phi-3's partial rotary and LongRoPE factors),
in files made by llama.cpp's converter and quantizer (tests/fixtures/llamacpp): the config
comes from the file (Granite's four scales; SmolLM3's layers without rotary, every fourth as
llama.cpp's graph fixes it), Q8_0 on its blocks is the file dequantized, and with fp32 weights
vserve's greedy ids are llama.cpp's own (Phi-3 on its short factors: the context, 256, is
within its original 512, as llama-server's was)."""

from __future__ import annotations

import pytest

from tests.support.llamacpp_files import (
    PROMPTS,
    fixture,
    greedy_and_logprobs,
    greedy_of_recorded_prompts,
    make_llm,
    worst_difference,
)

FAMILIES = ["granite", "olmo2", "smollm3", "gemma2", "phi3"]


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


@pytest.mark.parametrize("kind", FAMILIES)
def test_q8_0_on_its_blocks_is_the_dequantized_model(kind):
    path = fixture(f"tiny-{kind}-q8_0.gguf")
    ids, lps = greedy_and_logprobs(make_llm(path, "gguf"))
    ref_ids, ref_lps = greedy_and_logprobs(make_llm(path, "none"))
    assert ids == ref_ids
    assert worst_difference(lps, ref_lps) < 1e-4


@pytest.mark.parametrize("kind", FAMILIES)
def test_fp32_greedy_equals_llamacpp(kind):
    ours, llamacpp = greedy_of_recorded_prompts(f"tiny-{kind}-f32.gguf")
    assert ours == llamacpp


@pytest.mark.parametrize("half", ["bf16", "f16"])
def test_bf16_and_f16_files_hold_the_f32_files_weights_rounded(half):
    """BF16 and F16 files (llama-quantize of the F32 file) load dense: every weight is the F32
    file's rounded to the type, bit for bit."""
    import torch

    from vserve.models.gguf_source import iter_gguf_weights
    from vserve.models.resolve import resolve_model_path

    rounded = {"bf16": torch.bfloat16, "f16": torch.float16}[half]
    f32 = resolve_model_path(str(fixture("tiny-olmo2-f32.gguf")))
    ref = dict(iter_gguf_weights(f32, torch.float32, quantized=True))
    got = dict(
        iter_gguf_weights(
            resolve_model_path(str(fixture(f"tiny-olmo2-{half}.gguf"))),
            torch.float32,
            quantized=True,
        )
    )
    assert got.keys() == ref.keys()
    for name, w in ref.items():
        expect = w if w.dim() == 1 else w.to(rounded).float()  # the norms stay F32
        assert torch.equal(got[name], expect), name


def test_a_bf16_file_runs_as_the_f32_file_in_bf16():
    """In bf16 the BF16 file's model is the F32 file's: the same greedy ids and logprobs."""
    from vserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    for name in ("tiny-olmo2-bf16.gguf", "tiny-olmo2-f32.gguf"):
        llm = make_llm(fixture(name), dtype="bfloat16")
        try:
            outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        finally:
            llm.shutdown()
        runs.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs])
    assert runs[0] == runs[1]
