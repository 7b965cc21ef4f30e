"""The forward metadata every attention backend receives, and the backend interface.

The model runner builds one `AttentionMetadata` per step and passes it explicitly down the
model; nothing outlives the step. The KV cache of a layer is one tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, then values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each token's K/V
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    query_start_loc_cpu: list[int]  # host copies, for per-request loops
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    backend_data: Any = None  # built by the backend's `prepare`
    # the sliding-window layers' own KV group (None: every layer uses the tables above)
    local_slot_mapping: torch.Tensor | None = None  # [num_tokens] int64
    local_block_tables: torch.Tensor | None = None  # [num_reqs, max_blocks_per_req] int32

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def kv_tables(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_tables) of the KV group of a layer with this window."""
        if window is not None and self.local_block_tables is not None:
            return self.local_slot_mapping, self.local_block_tables
        return self.slot_mapping, self.block_tables


@dataclass(frozen=True)
class AttentionLayerSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # keys with q_pos - k_pos < window are visible
    logit_softcap: float | None = None


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> Any:
        """Build per-step data shared by all layers (gather indices, masks)."""

    def forward(
        self,
        spec: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        ...


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of the KV write: scatter each token's K/V into its slot."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
