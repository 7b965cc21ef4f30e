"""Supported architectures and how to build one pipeline stage of them."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "MistralForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "Qwen2ForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "Qwen3ForCausalLM": ("vserve.models.decoder", "DecoderForCausalLM"),
    "Gemma3ForCausalLM": ("vserve.models.gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


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
