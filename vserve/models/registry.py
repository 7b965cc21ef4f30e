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
# the architectures with no GGUF form (llama.cpp writes the Gemma 3 4B-27B text model as
# `gemma3`); every other one reads its GGUF files (their tensor names, llama.cpp's q/k row
# order and norm storage: gguf_source; configs: gguf_config)
_NO_GGUF = ("Gemma3ForConditionalGeneration",)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_gguf_architecture(architecture: str) -> None:
    """ValueError unless GGUF files of `architecture` load."""
    if architecture not in _MODELS or architecture in _NO_GGUF:
        readable = sorted(a for a in _MODELS if a not in _NO_GGUF)
        raise ValueError(
            f"GGUF files of {architecture} are not supported; vserve reads GGUF files of "
            f"{', '.join(readable)} (load this model from its safetensors checkpoint instead)"
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
