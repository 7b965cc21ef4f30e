"""Dense (unpaged) attention used as the reference for the paged backends, and random batches
of prefill chunks and decode rows laid out in a paged KV cache."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata


def dense_attention(q, k, v, q_pos, spec: AttentionLayerSpec) -> torch.Tensor:
    """q [Q, H, D] at positions q_pos; k, v [L, Hkv, D] for positions 0..L-1."""
    groups = spec.num_heads // spec.num_kv_heads
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * spec.scale
    if spec.logit_softcap:
        scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    kpos = torch.arange(k.shape[0])
    visible = kpos[None, :] <= q_pos[:, None]
    if spec.sliding_window is not None:
        visible &= kpos[None, :] > q_pos[:, None] - spec.sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], -1)


@dataclass
class PagedCase:
    meta: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # full K, V per request (host)

    def to(self, device) -> PagedCase:
        """The same case with the kernels' inputs on `device` (the reference stays on the host)."""
        names = ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")
        meta = dataclasses.replace(
            self.meta, **{n: getattr(self.meta, n).to(device) for n in names}
        )
        on = [t.to(device) for t in (self.query, self.key, self.value, self.kv_cache)]
        return PagedCase(meta, *on, self.contexts)


def make_case(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=torch.float32,
    seed: int = 0,
) -> PagedCase:
    """Requests with `ctx_lens[i]` tokens after this step, of which the last `q_lens[i]` are
    queried now; earlier K/V are already in the cache, this step's are in key/value."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    flat_k = kv_cache[0].view(-1, num_kv_heads, head_dim)
    flat_v = kv_cache[1].view(-1, num_kv_heads, head_dim)
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    qs, ks, vs, slots, positions, contexts = [], [], [], [], [], []
    for i, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        blocks = [free.pop() for _ in range(-(-ctx // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        contexts.append((k, v))
        pos = torch.arange(ctx)
        slot = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        flat_k[slot[: ctx - q_len]] = k[: ctx - q_len]
        flat_v[slot[: ctx - q_len]] = v[: ctx - q_len]
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(k[ctx - q_len :])
        vs.append(v[ctx - q_len :])
        slots.append(slot[ctx - q_len :])
        positions.append(pos[ctx - q_len :])
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        num_tokens=qsl[-1],
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=tables,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(ctx_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
    )
    return PagedCase(meta, torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, contexts)


def reference_output(case: PagedCase, spec: AttentionLayerSpec) -> torch.Tensor:
    outs = []
    qsl = case.meta.query_start_loc_cpu
    for i, (k, v) in enumerate(case.contexts):
        q = case.query[qsl[i] : qsl[i + 1]].to(k.device)
        ctx = k.shape[0]
        q_pos = torch.arange(ctx - q.shape[0], ctx)
        outs.append(dense_attention(q, k, v, q_pos, spec))
    return torch.cat(outs)
