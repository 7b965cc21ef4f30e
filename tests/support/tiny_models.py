"""Tiny random-weight models built with transformers, plus a small byte-level BPE tokenizer.

Each model is saved once per test session as a Hugging Face folder (config.json, safetensors,
tokenizer files), exactly what a user would point vserve at.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Paris is the capital of France, and Berlin is the capital of Germany. ",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a little engine that could schedule tokens. ",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 ",
    "héllo wörld, naïve café — 東京 🙂 ",
] * 20


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "</s>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(str(folder))
    return fast


FAMILY_KINDS = ["granite", "olmo2", "smollm3", "phi3", "gemma2"]  # beyond the first five
MOE_KINDS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]  # mixtures of experts
MODEL_KINDS = ["llama", "qwen2", "qwen3", "gemma3", "mistral", *FAMILY_KINDS, *MOE_KINDS]
# 8 experts, 2 a token; Qwen3-MoE renormalizes the top 2 and keeps layer 1 dense, Qwen2-MoE
# adds its gated shared expert, OLMoE keeps the raw top-2 probabilities
MOE_KNOBS = {
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        head_dim=32,
    ),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False),
}
# each family's own knobs away from their neutral values: Granite's multipliers, SmolLM3's
# layers without rotary (every third), Gemma 2's soft-capping (small caps, so that they bite),
# Phi-3's partial rotary and LongRoPE (the tests' contexts stay within its original 512
# positions: its short factors, with the attention factor of the scaled context, not 1)
# what the tiny Gemma 2 and Gemma 3 share
GEMMA_SHAPE = dict(
    head_dim=32, sliding_window=16, query_pre_attn_scalar=32, tie_word_embeddings=True
)
FAMILY_KNOBS = {
    "granite": dict(
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.15,
        logits_scaling=1.5,
    ),
    "smollm3": dict(no_rope_layer_interval=3, tie_word_embeddings=True),
    "gemma2": dict(  # Gemma 3's shape without q/k norms, soft-capped scores and logits
        **GEMMA_SHAPE,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "phi3": dict(
        partial_rotary_factor=0.5,
        original_max_position_embeddings=512,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.3, 2.0, 4.0],
            "long_factor": [1.5, 3.0, 6.0, 12.0],
        },
    ),
}


def _config(kind: str, **overrides):
    from transformers import (
        Gemma2Config,
        Gemma3Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        OlmoeConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        cfg = LlamaConfig(**common)
    elif kind == "mistral":
        cfg = MistralConfig(**{**common, "sliding_window": 24})
    elif kind == "qwen2":
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True})
    elif kind == "qwen3":
        cfg = Qwen3Config(**{**common, "head_dim": 32})
    elif kind == "gemma3":
        cfg = Gemma3TextConfig(**{**common, **GEMMA_SHAPE, "num_hidden_layers": 6})
    elif kind == "gemma3-mm":  # the 4B-27B checkpoints' multimodal wrapper, a tiny SigLIP
        text = Gemma3TextConfig(**{**common, **GEMMA_SHAPE, "num_hidden_layers": 6})
        vision = dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        cfg = Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision,
            mm_tokens_per_image=4,
            boi_token_index=VOCAB - 3,
            eoi_token_index=VOCAB - 2,
            image_token_index=VOCAB - 1,
        )
    elif kind in FAMILY_KINDS:
        families = dict(
            granite=GraniteConfig,
            olmo2=Olmo2Config,
            smollm3=SmolLM3Config,
            phi3=Phi3Config,
            gemma2=Gemma2Config,
        )
        cfg = families[kind](**{**common, **FAMILY_KNOBS.get(kind, {})})
    elif kind in MOE_KINDS:
        families = dict(
            qwen3_moe=Qwen3MoeConfig,
            qwen2_moe=Qwen2MoeConfig,
            mixtral=MixtralConfig,
            olmoe=OlmoeConfig,
        )
        cfg = families[kind](**{**common, **MOE_KNOBS[kind]})
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_model(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = _config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # weights large enough that greedy text varies (a model stuck on one token would hide
    # feedback bugs) and top-2 logit gaps stay far above fp32 rounding
    gemma = kind.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name and gemma:
                p.normal_(0.0, 0.03)
            elif p.dim() > 1:
                p.normal_(0.0, 0.3 if gemma else 0.25)
            elif "norm" in name:
                p.normal_(0.0, 0.5) if gemma else p.normal_(1.0, 0.1)
    model.save_pretrained(str(folder))
    build_tokenizer(folder)
    return folder


def cache_dir() -> Path:
    root = os.environ.get("VSERVE_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vserve-tests"
    )
    return Path(root)


THINK_TOKENS = ("<think>", "</think>")  # one token each, as in Qwen3's and DeepSeek-R1's
THINKING_TEMPLATE = (  # DeepSeek-R1's habit: the prompt opens the thought (thinking off: shut)
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>"
    "{% if enable_thinking is defined and not enable_thinking %}</think>{% endif %}"
    "{% endif %}"
)


def thinking_model(tiny_model_dir) -> str:
    """A tiny Qwen3 whose tokenizer has `<think>` and `</think>` as single tokens (ids 384
    and 385, within its vocabulary of 392) and a template that opens the thought."""
    from transformers import AutoTokenizer

    folder = tiny_model_dir("qwen3", vocab_size=VOCAB + 8)
    tok = AutoTokenizer.from_pretrained(folder)
    if THINK_TOKENS[1] not in tok.get_vocab():
        tok.add_tokens(list(THINK_TOKENS))
        tok.chat_template = THINKING_TEMPLATE
        tok.save_pretrained(folder)
    return folder
