"""The dense families beyond the first five (Granite, OLMo 2, SmolLM3, Phi-3, Gemma 2): the
fused CPU decode layers run only those whose layers are Llama's or Gemma's (Phi-3, partial
rotary included, and Gemma 2), their bf16 path stays within bf16 noise of transformers' bf16,
Phi-3's LongRoPE table, and the architectures a model may name (the families' GGUF files:
test_gguf_families.py). Their fp32 greedy tokens equal
transformers': tests/e2e/test_equivalence_hf.py."""

import pytest
import torch

from tests.models.test_bf16_vs_transformers import PROMPTS, _within, logprob_differences
from tests.support.engines import make_llm
from tests.support.tiny_models import _config
from vserve import SamplingParams, cpu_ops
from vserve.models.hf_config import ModelHFConfig, load_hf_config
from vserve.models.layers import rope_inv_freq
from vserve.models.packed_linear import can_pack
from vserve.models.registry import model_class, resolve_architecture
from vserve.models.stage import StageInfo

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}


def _meta_model(kind: str, **overrides):
    cfg = _config(kind, **overrides)
    with torch.device("meta"):
        return model_class(ARCHITECTURES[kind])(cfg, StageInfo.whole(4), 64)


@pytest.mark.parametrize(
    "kind, overrides, fused",
    [
        ("llama", {}, True),
        ("granite", {}, False),  # sublayer outputs scaled by 0.5
        # the embedding and logits multipliers act outside the layers, the attention
        # scale is one of the fused layer's constants
        ("granite", {"residual_multiplier": 1.0}, True),
        ("smollm3", {}, False),  # layer 2 has no rotary
        ("smollm3", {"no_rope_layers": [1, 1, 1, 1]}, True),
        # a rotary over half the head: the fused layers' rotary takes the table's width
        # (bitwise the per-op path: tests/workers/test_cpu_ops.py)
        ("phi3", {}, True),
        ("olmo2", {}, False),  # post-norms, q/k norms over the whole projection
        ("gemma2", {}, True),  # Gemma 3's layer without the q/k norms
    ],
)
def test_the_fused_decode_layers_run_only_llama_or_gemma_shaped_layers(kind, overrides, fused):
    assert _meta_model(kind, **overrides).supports_fused_decode is fused


# |vserve bf16 - transformers bf16| logprobs (max, median) over the sampled and top-3 tokens
# at 24 positions of 3 prompts (as tests/models/test_bf16_vs_transformers.py measures them).
# Measured on a Xeon with AMX: granite 0.096 / 0.015, olmo2 0.075 / 0.0072, smollm3
# 0.22 / 0.028, phi3 0.28 / 0.030, gemma2 0.026 / 0.0041 (llama there: 0.26 / 0.030, gemma3
# 0.011 / 0.0036). The bounds are about twice those; the fused decode layers forced onto
# Granite or SmolLM3 (residual multiplier and layers without rotary ignored) give 4.8 / 0.46
# and 2.1 / 0.24.
TOLERANCE = {
    "granite": (0.2, 0.03),
    "olmo2": (0.15, 0.015),
    "smollm3": (0.45, 0.06),
    "phi3": (0.5, 0.06),
    "gemma2": (0.05, 0.008),
}
FUSED = ("phi3", "gemma2")  # the kinds whose layers the fused decode layers compute


@pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16), reason="no native bf16 on this CPU"
)
@pytest.mark.parametrize("kind", list(TOLERANCE))
def test_bf16_logprobs_stay_within_bf16_noise_of_transformers(kind, tiny_model_dir):
    model_dir = tiny_model_dir(kind)
    llm = make_llm(model_dir, dtype="bfloat16", max_model_len=128)
    try:
        model = llm.engine.client.core.executor.worker.runner.model
        assert model.kernel is not None or cpu_ops.load() is None  # the CPU kernels
        assert (model.fused is not None) == (model.kernel is not None and kind in FUSED)
        measured = logprob_differences(llm, model_dir, PROMPTS, 24)
    finally:
        llm.shutdown()
    assert _within(measured, TOLERANCE[kind]), measured


def test_longrope_takes_its_long_factors_when_the_context_passes_the_original_length():
    """One table for the engine, as vLLM: short factors up to the original 512 positions,
    long ones beyond; the attention factor of the scaled context (1024 / 512) either way.
    The resolved config the workers read (`ModelHFConfig`) gives transformers' values."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config("phi3")
    longrope = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = longrope(cfg, None)
    long, _ = longrope(cfg, None, seq_len=513)
    assert factor > 1.0 and not torch.equal(short, long)
    resolved = ModelHFConfig(**cfg.to_dict())
    for max_positions, want in ((512, short), (513, long)):
        inv_freq, scaling = rope_inv_freq(resolved, max_positions=max_positions)
        assert torch.equal(inv_freq, want) and scaling == factor
    assert 2 * short.numel() == 8  # a partial rotary: 8 of the 16 head dims


def test_an_unsupported_architecture_names_every_supported_one():
    with pytest.raises(ValueError, match="unsupported model architecture") as error:
        resolve_architecture(["GPT2LMHeadModel"])
    assert all(arch in str(error.value) for arch in ARCHITECTURES.values())


def test_gemma3_multimodal_checkpoints_run_their_text_model(tiny_model_dir):
    """A Gemma3ForConditionalGeneration checkpoint (the 4B-27B ones; a tiny SigLIP here):
    its `text_config` is the config, its vision tower and projector are not loaded, and the
    greedy tokens of text prompts are transformers' multimodal model's (fp32)."""
    from tests.support.hf_reference import PROMPTS as TEXT
    from tests.support.hf_reference import hf_greedy

    model_dir = tiny_model_dir("gemma3-mm")
    config = load_hf_config(model_dir)
    assert config.architectures == ["Gemma3ForConditionalGeneration"]
    assert config.num_hidden_layers == 6 and config.head_dim == 32 and config.vocab_size == 384
    from vserve.models.gemma3 import _strip  # the checkpoint names the text model reads

    assert _strip("vision_tower.encoder.layers.0.mlp.fc1.weight") is None
    assert _strip("model.multi_modal_projector.mm_input_projection_weight") is None
    assert _strip("language_model.model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert _strip("model.language_model.norm.weight") == "model.norm.weight"
    llm = make_llm(model_dir, max_model_len=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(TEXT, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == hf_greedy(model_dir, tuple(TEXT), 16)


def test_the_wrapper_s_own_eos_and_dtype_win_over_the_text_config_s():
    from vserve.models.hf_config import text_tower

    values = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 8, "eos_token_id": 1, "torch_dtype": None},
    }
    text = text_tower(values)
    assert text["eos_token_id"] == [1, 106] and text["torch_dtype"] == "bfloat16"
    assert text["hidden_size"] == 8 and text["architectures"] == values["architectures"]
    assert text_tower({"architectures": ["LlamaForCausalLM"], "text_config": {}}) == {
        "architectures": ["LlamaForCausalLM"],
        "text_config": {},
    }


def test_gguf_files_of_architectures_without_gguf_support_are_refused():
    """The multimodal wrapper has no GGUF form (llama.cpp writes its text model as Gemma 3):
    such a file is refused with the list of those that load."""
    from vserve.models.registry import check_gguf_architecture

    with pytest.raises(ValueError, match="GGUF files of Gemma3ForConditionalGeneration .*Olmoe"):
        check_gguf_architecture("Gemma3ForConditionalGeneration")
    check_gguf_architecture("OlmoeForCausalLM")
