"""A GGUF file's config where transformers' GGUF reader falls short, while a file is described
(`resolve.convert_gguf`).

Architectures it does not know (Granite, OLMo 2, SmolLM3 and OLMoE, as llama.cpp's converter
writes them) are taught to it. transformers reads a GGUF's config and tokenizer through one table of
metadata keys per architecture (`GGUF_CONFIG_MAPPING`) and a list of the architectures it
accepts; `known_architectures()` adds these for the duration, so the config class is the
family's own (`model_type` is the file's architecture) and the tokenizer comes out as for any
other file.

Keys llama.cpp does not write take llama.cpp's own assumption: SmolLM3 skips rotary in every
fourth layer (llama.cpp's graph hard-codes the interval, as the released checkpoints have it).

Architectures it knows but reads in part are completed from the file (`completed_config`): a
mixture's expert sizes, a Mixtral file (llama.cpp's `llama` with experts) as Mixtral, Gemma 2's
soft-caps, Phi-3's partial rotary and LongRoPE factors (stored as tensors).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

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
    # OLMoE: each expert's size is feed_forward_length (its config's intermediate_size)
    "olmoe": {**_COMMON, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"},
}
DEFAULTS = {"smollm3": {"no_rope_layer_interval": 4}}


_TABLES = threading.RLock()  # transformers' tables are module-wide: one description at a time


@contextmanager
def known_architectures():
    """transformers' GGUF reader accepts MAPPINGS' architectures while this lasts (one
    thread at a time: the tables are transformers' module-wide state)."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.integrations import ggml

    with _TABLES:
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


# a mixture's GGUF keys transformers' config mapping leaves out -> the config's names
_EXPERT_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def _experts_config(config, fields):
    """A mixture of experts' config as the file's keys say: transformers' mapping leaves the
    experts' intermediate size at its default, and reads a Mixtral file (llama.cpp writes
    it as `llama` with experts) as a dense Llama. Qwen3-MoE renormalizes its top k, as
    llama.cpp's graph does for every `qwen3moe` file."""
    arch = fields["general.architecture"].contents()
    found = {
        attr: int(fields[f"{arch}.{key}"].contents())
        for key, attr in _EXPERT_KEYS.items()
        if f"{arch}.{key}" in fields
    }
    if config.model_type == "llama":
        if not found.get("num_experts"):
            return config
        from transformers import MixtralConfig

        dense = config.to_dict()
        for key in ("model_type", "architectures", "transformers_version"):
            dense.pop(key, None)
        # a Mixtral expert's size is the file's feed_forward_length (intermediate_size)
        return MixtralConfig(
            **dense,
            num_local_experts=found["num_experts"],
            num_experts_per_tok=found["num_experts_per_tok"],
        )
    for attr, value in found.items():
        setattr(config, attr, value)
    if config.model_type == "qwen3_moe":
        config.norm_topk_prob = True
    return config


def completed_config(config, gguf: Path):
    """transformers' config of `gguf`, with what the file says and transformers' reader
    leaves out (the module's docstring)."""
    if config.model_type not in ("qwen3_moe", "qwen2_moe", "llama", "gemma2", "phi3"):
        return config
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    if config.model_type == "gemma2":
        return _gemma2_config(config, reader.fields)
    if config.model_type == "phi3":
        return _phi3_config(config, reader)
    return _experts_config(config, reader.fields)


def _gemma2_config(config, fields):
    """Gemma 2's soft-caps, from the file (transformers keeps the 2B/9B defaults); the query
    scale as llama.cpp's graph takes it: 1 / sqrt(head_dim), and 1 / sqrt(hidden / heads) for
    the 27B model (46 layers), whose checkpoint says 144."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"gemma2.{key}" in fields:
            setattr(config, key, float(fields[f"gemma2.{key}"].contents()))
    if config.num_hidden_layers == 46:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim
    return config


def _phi3_config(config, reader):
    """Phi-3's rotary: its dimension (partial rotary) and, where the file holds LongRoPE's
    factors (tensors `rope_factors_long` / `_short`), LongRoPE with the original context."""
    import numpy as np

    fields = reader.fields
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = int(fields["phi3.rope.dimension_count"].contents())
    factors = {
        t.name.split(".")[0].removeprefix("rope_factors_"): np.asarray(t.data, dtype=np.float64)
        for t in reader.tensors
        if t.name.startswith("rope_factors_")
    }
    params = dict(config.rope_parameters or {})
    params["partial_rotary_factor"] = rotary / head_dim
    config.partial_rotary_factor = rotary / head_dim
    if "long" in factors and "short" in factors:
        original = int(fields["phi3.rope.scaling.original_context_length"].contents())
        params |= {
            "rope_type": "longrope",
            "long_factor": [float(f) for f in factors["long"]],
            "short_factor": [float(f) for f in factors["short"]],
            "original_max_position_embeddings": original,
        }
        config.original_max_position_embeddings = original
    config.rope_parameters = params
    return config
