"""Paged attention in plain torch: the CPU path and the oracle for the Triton kernels.

Per step, `prepare` sorts the batch into groups that each need one attention call per layer:

* decode rows (one query token each): one padded batch; whole KV blocks are gathered through
  the block tables and attention is two batched matmuls (GQA without copying K/V). With the
  fused CPU kernels (bf16, `kernel` set by the model runner) one kernel call reads the paged
  cache in place instead;
* prefills without earlier context, grouped by length: attention on this step's own K/V
  (nothing to gather);
* prefill chunks with context (chunked prefill, prefix hits): per request, against its
  gathered context.

Masks are causal and, for sliding-window layers, `k_pos > q_pos - window`. A prefill's queries
run in tiles of `PREFILL_TILE` rows, each one `scaled_dot_product_attention` over the keys it
can see (`_Tile`): a sliding-window layer's work grows with window x length, not length^2,
and a chunk after earlier context is not charged for keys it cannot see; a prefill of a layer
without a window and without context is one causal call. When sliding-window layers have
their own KV group (`meta.local_block_tables`), they gather through its block tables, in which
blocks that left the window point at a null block of zeros (masked out like any slot past the
window); a chunk gathers only from the first block its window reaches.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata, write_kv

# query rows per attention call in a prefill: a sliding-window layer then computes
# (PREFILL_TILE + window) keys a query at most, and a tile's causal triangle is small
PREFILL_TILE = 128


@dataclass(frozen=True)
class _Tile:
    """Query rows [q0, q1) of a prefill against the keys at positions [k0, k1); mask
    [1, 1, q1 - q0, k1 - k0] True = visible, None: causal with q1 - q0 == k1 - k0."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: torch.Tensor | None


@dataclass
class _Group:
    kind: str  # "decode" | "direct" | "context"
    token_idx: torch.Tensor | None  # [B * Q] query tokens of the group, row-major
    num_rows: int  #   (None: the whole step, in order)
    q_len: int
    blocks: torch.Tensor | None  # [B, num_blocks] block ids to gather (None: direct)
    local_blocks: torch.Tensor | None  # the same in the sliding-window KV group (or None)
    # decode groups, per window: [B, 1, 1, L] True = hidden (None with the fused kernel)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    seq_lens: torch.Tensor | None = None  # decode groups: [B] int64 context lengths
    # prefill groups, per window: the query tiles (key positions from 0, before `first`)
    tiles: dict[int | None, list[_Tile]] = field(default_factory=dict)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kernel = None  # vserve.cpu_ops module for bf16 CPU models

    # -- per step ------------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> list[_Group]:
        if meta.max_query_len == 1:  # decode only: one group, every row in order
            return [self._decode_group(meta, None, windows)]
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        q_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        direct: dict[int, list[int]] = defaultdict(list)
        groups = []
        for i, n in enumerate(q_lens):
            if n > 1 and n == seq_lens[i]:
                direct[n].append(i)
            elif n > 1:
                groups.append(self._context_group(meta, i, n, windows))
        if decode:
            groups.append(self._decode_group(meta, decode, windows))
        for n, rows in direct.items():
            groups.append(self._direct_group(meta, rows, n, windows))
        if len(groups) == 1 and groups[0].num_rows == meta.num_reqs:
            groups[0].token_idx = None  # one group holds every token in order: no gathers
        return groups

    def _num_blocks(self, length: int) -> int:
        return -(-length // self.block_size)

    def _decode_group(self, meta, rows, windows) -> _Group:
        """rows: the decode rows, or None when every row decodes (no gathers)."""
        device = meta.block_tables.device
        if rows is None:
            rows_t, num_rows = slice(None), meta.num_reqs
            nb = self._num_blocks(meta.max_seq_len)
        else:
            rows_t, num_rows = torch.tensor(rows, device=device), len(rows)
            nb = self._num_blocks(max(meta.seq_lens_cpu[i] for i in rows))
        seq_lens = meta.seq_lens[rows_t].long()
        masks = {}
        if self.kernel is None:  # the kernel masks by position itself
            j = torch.arange(nb * self.block_size, device=device)
            masks = {
                w: ~_visible(seq_lens.view(-1, 1, 1, 1) - 1, j, w)  # [B, 1, 1, L]
                for w in windows
            }
        token_idx = None if rows is None else meta.query_start_loc[:-1][rows_t].long()
        local = meta.local_block_tables
        return _Group(
            "decode",
            token_idx,
            num_rows,
            1,
            meta.block_tables[rows_t, :nb].long(),
            None if local is None else local[rows_t, :nb].long(),
            masks,
            seq_lens,
        )

    def _direct_group(self, meta, rows, q_len, windows) -> _Group:
        device = meta.block_tables.device
        starts = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], device=device)
        token_idx = (starts.unsqueeze(1) + torch.arange(q_len, device=device)).reshape(-1)
        tiles = {w: _prefill_tiles(0, q_len, w, device) for w in windows}
        return _Group("direct", token_idx, len(rows), q_len, None, None, tiles=tiles)

    def _context_group(self, meta, row, q_len, windows) -> _Group:
        device = meta.block_tables.device
        seq_len, start = meta.seq_lens_cpu[row], meta.query_start_loc_cpu[row]
        nb = self._num_blocks(seq_len)
        tiles = {w: _prefill_tiles(seq_len - q_len, q_len, w, device) for w in windows}
        token_idx = torch.arange(start, start + q_len, device=device)
        local = meta.local_block_tables
        return _Group(
            "context",
            token_idx,
            1,
            q_len,
            meta.block_tables[row, :nb].long().unsqueeze(0),
            None if local is None else local[row, :nb].long().unsqueeze(0),
            tiles=tiles,
        )

    # -- per layer -----------------------------------------------------------------------------
    def forward(
        self, spec: AttentionLayerSpec, query, key, value, kv_cache, meta: AttentionMetadata
    ) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.kv_tables(spec.sliding_window)[0])
        groups = meta.backend_data
        if groups[0].token_idx is None:
            return self._group(groups[0], spec, query, key, value, kv_cache).reshape(
                query.shape[0], -1
            )
        out = torch.empty_like(query)
        for g in groups:
            out[g.token_idx] = self._group(
                g, spec, query[g.token_idx], key[g.token_idx], value[g.token_idx], kv_cache
            )
        return out.view(query.shape[0], -1)

    def _group(self, g: _Group, spec, query, key, value, kv_cache) -> torch.Tensor:
        """Attention for one group's query rows [B * Q, H, D] -> [B * Q, H, D]."""
        blocks = (
            g.blocks if spec.sliding_window is None or g.local_blocks is None else g.local_blocks
        )
        if g.kind == "decode" and self.kernel is not None:
            return self.kernel.decode_attention(
                query.contiguous(),
                kv_cache[0],
                kv_cache[1],
                blocks,
                g.seq_lens,
                spec.sliding_window or -1,
                spec.scale,
                spec.logit_softcap or 0.0,
            )
        b, n = g.num_rows, g.q_len
        q = query.view(b, n, *query.shape[1:]).transpose(1, 2)  # [B,H,Q,D]
        tiles = g.tiles.get(spec.sliding_window, [])
        first = 0  # the position of the first key gathered
        if g.blocks is None:
            k, v = key.view(b, n, *key.shape[1:]), value.view(b, n, *value.shape[1:])
        else:
            if g.kind != "decode":  # from the first block the earliest tile reaches
                skip = tiles[0].k0 // self.block_size
                blocks, first = blocks[:, skip:], skip * self.block_size
            k = _gather_blocks(kv_cache[0], blocks)  # [B,L,Hkv,D]
            v = _gather_blocks(kv_cache[1], blocks)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B,Hkv,L,D]
        if g.kind == "decode":
            o = _attend_matmul(q, k, v, g.masks[spec.sliding_window], spec)
        else:
            o = _attend_tiles(q, k, v, tiles, first, spec)  # [B,H,Q,D]
        return o.transpose(1, 2).reshape(b * n, *query.shape[1:])


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility; q_pos broadcasts against k_pos [L]."""
    m = k_pos <= q_pos
    return m if window is None else m & (k_pos > q_pos - window)


def _prefill_tiles(start: int, q_len: int, window: int | None, device) -> list[_Tile]:
    """The tiles of q_len queries at positions start.. (keys from position 0): one causal tile
    where the queries see exactly their own keys, else PREFILL_TILE rows each, against the
    keys from the first one the tile's first query sees (its window) to the last query."""
    if start == 0 and (window is None or window >= q_len):
        return [_Tile(0, q_len, 0, q_len, None)]
    tiles = []
    for q0 in range(0, q_len, PREFILL_TILE):
        q1 = min(q_len, q0 + PREFILL_TILE)
        p0, p1 = start + q0, start + q1  # query positions [p0, p1)
        k0 = 0 if window is None else max(0, p0 - window + 1)
        if k0 == p0 and (window is None or window >= q1 - q0):
            tiles.append(_Tile(q0, q1, k0, p1, None))  # its own keys alone: causal
            continue
        pos = torch.arange(p0, p1, device=device).view(1, 1, -1, 1)
        mask = _visible(pos, torch.arange(k0, p1, device=device), window)
        tiles.append(_Tile(q0, q1, k0, p1, mask))
    return tiles


def _attend_tiles(q, k, v, tiles: list[_Tile], first: int, spec) -> torch.Tensor:
    """q [B, H, Q, D]; k/v [B, Hkv, L, D] the keys from position `first`."""

    def attend(t: _Tile) -> torch.Tensor:
        ks = slice(t.k0 - first, t.k1 - first)
        return _attend(q[:, :, t.q0 : t.q1], k[:, :, ks], v[:, :, ks], t.mask, spec)

    if len(tiles) == 1:  # every query: its result is the output, no copy
        return attend(tiles[0])
    out = q.new_empty(q.shape)
    for t in tiles:
        out[:, :, t.q0 : t.q1] = attend(t)
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], blocks [B, nb] -> [B, nb * block_size, Hkv, D].
    Whole blocks are copied (contiguous runs), far cheaper than per-slot indexing."""
    b, nb = blocks.shape
    _, bs, h, d = cache.shape
    rows = cache.view(cache.shape[0], -1)  # 2-D rows take index_select's fast copy path
    return rows.index_select(0, blocks.reshape(-1)).view(b, nb * bs, h, d)


def _attend(q, k, v, mask, spec: AttentionLayerSpec) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, L, D], mask [B|1, 1, Q, L] (True = visible; None: causal
    over Q == L)."""
    if spec.logit_softcap is not None:
        if mask is None:
            n = q.shape[2]
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None, None]
        return _attend_matmul(q, k, v, ~mask, spec)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=spec.scale,
        enable_gqa=spec.num_heads != spec.num_kv_heads,
    )


def _attend_matmul(q, k, v, hidden, spec: AttentionLayerSpec) -> torch.Tensor:
    """Two batched matmuls in the model's dtype (fp32 accumulation inside), softmax in fp32,
    as transformers' eager attention does; the query heads of one KV head share its K/V (a
    view, no copy). Fast for short queries (decode), and handles logit softcap.
    `hidden` [B|1, 1, Q, L] is True where a key is masked out."""
    b, h, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups = h // hkv
    qg = q.reshape(b, hkv, groups * n, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * spec.scale
    if spec.logit_softcap is not None:
        scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    scores = scores.view(b, hkv, groups, n, length).masked_fill(hidden.unsqueeze(2), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(b, hkv, groups * n, length)
    return torch.matmul(probs, v).view(b, h, n, d)
