"""Paged attention in plain torch: gather each request's K/V through its block table, then
`scaled_dot_product_attention` (GQA without copies, causal and sliding-window masks).

Decode rows (one query token) run as one padded batch; prefill chunks run one request at a
time against their whole context. This is the CPU path and the oracle for the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata, write_kv


@dataclass
class _Group:
    token_idx: torch.Tensor | slice   # which query tokens the group covers
    blocks: torch.Tensor | None       # [B, num_blocks] block ids to gather (None: no context)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # [B, 1, Q, L] bool


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    # -- per step ------------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> list[_Group]:
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        q_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
        decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
        groups = []
        if decode_rows:
            groups.append(self._decode_group(meta, decode_rows, windows))
        for i, n in enumerate(q_lens):
            if n > 1:
                groups.append(self._prefill_group(meta, i, qsl[i], n, seq_lens[i], windows))
        return groups

    def _num_blocks(self, length: int) -> int:
        return -(-length // self.block_size)

    def _decode_group(self, meta, rows, windows) -> _Group:
        device = meta.block_tables.device
        rows_t = torch.tensor(rows, device=device)
        max_len = max(meta.seq_lens_cpu[i] for i in rows)
        nb = self._num_blocks(max_len)
        blocks = meta.block_tables[rows_t, :nb].long()                  # [B, nb]
        seq_lens = meta.seq_lens[rows_t].long().unsqueeze(1)            # [B, 1]
        j = torch.arange(nb * self.block_size, device=device).unsqueeze(0)
        valid = j < seq_lens
        masks = {}
        for w in windows:
            m = valid if w is None else valid & (j > seq_lens - 1 - w)
            masks[w] = m[:, None, None, :]
        token_idx = meta.query_start_loc[:-1][rows_t].long()
        return _Group(token_idx, blocks, masks)

    def _prefill_group(self, meta, row, start, q_len, seq_len, windows) -> _Group:
        device = meta.block_tables.device
        direct = q_len == seq_len   # no earlier context: attend to this step's K/V as they are
        length = seq_len if direct else self._num_blocks(seq_len) * self.block_size
        blocks = None if direct else meta.block_tables[row, :self._num_blocks(seq_len)].long()
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
        j = torch.arange(length, device=device).unsqueeze(0)
        causal = j <= q_pos
        masks = {}
        for w in windows:
            m = causal if w is None else causal & (j > q_pos - w)
            masks[w] = m[None, None]
        return _Group(slice(start, start + q_len),
                      None if blocks is None else blocks.unsqueeze(0), masks)

    # -- per layer -----------------------------------------------------------------------------
    def forward(self, spec: AttentionLayerSpec, query, key, value, kv_cache,
                meta: AttentionMetadata) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        for group in meta.backend_data:
            decode = isinstance(group.token_idx, torch.Tensor)
            q = query[group.token_idx]
            q = q.unsqueeze(1) if decode else q.unsqueeze(0)          # [B, Q, H, D]
            if group.blocks is None:
                k = key[group.token_idx].unsqueeze(0)                  # [1, L, Hkv, D]
                v = value[group.token_idx].unsqueeze(0)
            else:
                k = _gather_blocks(kv_cache[0], group.blocks)
                v = _gather_blocks(kv_cache[1], group.blocks)
            o = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        group.masks[spec.sliding_window], spec)
            o = o.transpose(1, 2)                                     # [B, Q, H, D]
            if decode:
                out[group.token_idx] = o[:, 0]
            else:
                out[group.token_idx] = o[0]
        return out.view(query.shape[0], -1)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], blocks [B, nb] -> [B, nb * block_size, Hkv, D].
    Whole blocks are copied (contiguous runs), far cheaper than per-slot indexing."""
    b, nb = blocks.shape
    _, bs, h, d = cache.shape
    return cache.index_select(0, blocks.reshape(-1)).view(b, nb * bs, h, d)


def _attend(q, k, v, mask, spec: AttentionLayerSpec) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, L, D], mask [B, 1, Q, L] (True = visible)."""
    if spec.logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale,
                                              enable_gqa=spec.num_heads != spec.num_kv_heads)
    groups = spec.num_heads // spec.num_kv_heads
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * spec.scale
    scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1).to(v.dtype)) @ v
