"""GGUF architectures transformers' GGUF reader does not know, taught to it while a file is
described (`resolve.convert_gguf`): Granite, OLMo 2 and SmolLM3, as llama.cpp's converter
writes them. transformers reads a GGUF's config and tokenizer through one table of metadata
keys per architecture (`GGUF_CONFIG_MAPPING`) and a list of the architectures it accepts;
`known_architectures()` adds these three for the duration, so the config class is the
family's own (`model_type` is the file's architecture) and the tokenizer comes out as for any
other file.

Keys llama.cpp does not write take llama.cpp's own assumption: SmolLM3 skips rotary in every
fourth layer (llama.cpp's graph hard-codes the interval, as the released checkpoints have it).
"""

from __future__ import annotations

from contextlib import contextmanager

# what every llama.cpp text architecture writes
_COMMON = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": None,
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
MAPPINGS = {
    "granite": {
        **_COMMON,
        "attention.scale": "attention_multiplier",
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "logit_scale": "logits_scaling",
    },
    "olmo2": dict(_COMMON),
    "smollm3": dict(_COMMON),
}
DEFAULTS = {"smollm3": {"no_rope_layer_interval": 4}}


@contextmanager
def known_architectures():
    """transformers' GGUF reader accepts MAPPINGS' architectures while this lasts."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.integrations import ggml

    added = [a for a in MAPPINGS if a not in reader.GGUF_SUPPORTED_ARCHITECTURES]
    for arch in added:
        reader.GGUF_SUPPORTED_ARCHITECTURES.append(arch)
        ggml.GGUF_CONFIG_MAPPING[arch] = MAPPINGS[arch]
        ggml.GGUF_CONFIG_DEFAULTS_MAPPING[arch] = DEFAULTS.get(arch, {})
    try:
        yield
    finally:
        for arch in added:
            reader.GGUF_SUPPORTED_ARCHITECTURES.remove(arch)
            ggml.GGUF_CONFIG_MAPPING.pop(arch, None)
            ggml.GGUF_CONFIG_DEFAULTS_MAPPING.pop(arch, None)
