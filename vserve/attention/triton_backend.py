"""The Triton attention backend: one KV-write launch and one paged-attention launch per layer.

The whole mixed batch (prefill chunks and decode rows) goes through a single kernel launch
that reads `AttentionMetadata`'s device tensors directly, so there is no per-step host work
to share between layers and `prepare` builds nothing. The launches are CUDA-graph safe: grids
and tile sizes come from tensor shapes and the host ints `meta.max_query_len` and
`meta.max_seq_len` (decode graphs capture with 1 and the model's length, so a graph splits the
keys as the longest context would), never from device values. This module is imported only
through the backend registry, which keeps triton out of a plain `import vserve`.
"""

from __future__ import annotations

import torch

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata
from vserve.csrc_triton.kv_write import kv_write
from vserve.csrc_triton.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> None:
        return None

    def forward(
        self,
        spec: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        assert kv_cache.shape[2] == self.block_size, "KV cache block size differs from backend's"
        kv_write(key, value, kv_cache, meta.slot_mapping)
        return paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            spec,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )
