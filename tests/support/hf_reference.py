"""Greedy reference outputs from transformers' own `generate` (fp32), cached per model."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France, and Berlin is the capital of Germany. Paris is the "
    "capital of France, and",
    "1 2 3 4 5 6 7 8",
    "Once upon a time there was a little engine that could schedule tokens. Once upon a time "
    "there was a little engine that could schedule",
    "def add(a, b):\n    return a + b\n",
    "héllo wörld, naïve café",
]
SHARED_PREFIX = (
    "Once upon a time there was a little engine that could schedule tokens. "
    "The quick brown fox jumps over the lazy dog. "
)
PREFIX_PROMPTS = [SHARED_PREFIX + s for s in ["Paris is", "1 2 3", "def add(a, b):", "héllo"]] + [
    SHARED_PREFIX + "Paris is"
]


@functools.lru_cache(maxsize=None)
def hf_greedy(model_dir: str, prompts: tuple[str, ...], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = hf_model(model_dir, torch.float32)
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def hf_model(model_dir: str, dtype: torch.dtype):
    """transformers' model of a vserve model folder; a GGUF's folder (no weights of its own)
    loads its GGUF through transformers, which dequantizes every tensor (with gguf's own
    `dequantize`). Its config and its weights each parse the file's metadata with
    `gguf.GGUFReader`, 25 s apiece for the embedded model's 262k-token vocabulary: they share
    one reader whose values are plain views (`gguf_parsed_once`, the same fields and tensors:
    tests/models/test_gguf_source.py). The dequantized fp32 model is kept (the embedded one
    takes 8-16 s to load) and another dtype is a cast copy of it: transformers casts the same
    fp32 values when it loads a GGUF in that dtype (the embedded model in bf16: all 237
    tensors equal, checked 2026-12-02)."""
    from transformers import AutoModelForCausalLM

    from vserve.models.gguf_source import gguf_file

    gguf = gguf_file(model_dir)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    fp32 = _gguf_fp32_model(gguf)
    return fp32 if dtype == torch.float32 else copy.deepcopy(fp32).to(dtype)


@functools.lru_cache(maxsize=1)
def _gguf_fp32_model(gguf: str):
    from transformers import AutoModelForCausalLM

    from vserve.models.resolve import gguf_parsed_once

    with gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(
            str(Path(gguf).parent), gguf_file=Path(gguf).name, dtype=torch.float32
        ).eval()
