"""Supported architectures and how to build one pipeline stage of them."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "MistralForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "Qwen2ForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "Qwen3ForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "GraniteForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "SmolLM3ForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "Phi3ForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "Olmo2ForCausalLM": ("vserve.models.olmo2", "Olmo2ForCausalLM"),
    # mixture of experts
    "Qwen3MoeForCausalLM": ("vserve.models.moe", "MoEForCausalLM"),
    "Qwen2MoeForCausalLM": ("vserve.models.moe", "MoEForCausalLM"),
    "MixtralForCausalLM": ("vserve.models.moe", "MoEForCausalLM"),
    "OlmoeForCausalLM": ("vserve.models.moe", "MoEForCausalLM"),
    "Gemma2ForCausalLM": ("vserve.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForCausalLM": ("vserve.models.gemma3", "Gemma3ForCausalLM"),
    # the Gemma 3 4B-27B checkpoints: their text model (images are not read)
    "Gemma3ForConditionalGeneration": ("vserve.models.gemma3", "Gemma3ForCausalLM"),
}
# the architectures whose GGUF files load (their tensor names, llama.cpp's q/k row order and
# norm storage: gguf_source); the others load from safetensors only
_GGUF_MODELS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "SmolLM3ForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
    "OlmoeForCausalLM",
)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_gguf_architecture(architecture: str) -> None:
    """ValueError unless GGUF files of `architecture` load."""
    if architecture not in _GGUF_MODELS:
        raise ValueError(
            f"GGUF files of {architecture} are not supported; vserve reads GGUF files of "
            f"{', '.join(sorted(_GGUF_MODELS))} (load this model from its safetensors "
            "checkpoint instead)"
        )


def resolve_architecture(architectures: list[str] | None) -> str:
    for arch in architectures or []:
        if arch in _MODELS:
            return arch
    raise ValueError(
        f"unsupported model architecture {architectures}; vserve supports "
        f"{', '.join(supported_architectures())}"
    )


def model_class(architecture: str):
    module, cls = _MODELS[resolve_architecture([architecture])]
    return getattr(importlib.import_module(module), cls)
