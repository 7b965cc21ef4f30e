"""Attention backends behind one interface, chosen by name from a registry.

`torch` is the portable path (CPU default) and the oracle the Triton kernels are tested
against; `triton` is the CUDA default. Backends import their heavy dependencies lazily.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    # the interface types import torch: loaded on first use, so that the front end, which
    # only checks a backend's name, never imports torch
    if name in ("AttentionBackend", "AttentionMetadata"):
        from vserve.attention import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_REGISTRY = {
    "torch": ("vserve.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("vserve.attention.triton_backend", "TritonAttentionBackend"),
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def default_backend(device_type: str) -> str:
    return "triton" if device_type == "cuda" else "torch"


def get_attention_backend(name: str, block_size: int):
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {available_backends()}"
        )
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(block_size)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "get_attention_backend",
    "available_backends",
    "default_backend",
]
