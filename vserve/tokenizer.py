"""Tokenizer loading (transformers' fast tokenizers) with a clear error when it is missing."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
