"""Paged attention over a mixed batch of prefill chunks and decode rows in one launch.

Owns the Triton kernel, its launcher `paged_attention` and the plain-torch
`paged_attention_reference` with the same signature. The KV cache is
`[2, num_blocks, block_size, num_kv_heads, head_dim]` and must already hold this step's keys
and values (see `kv_write`). Request r queries tokens `query_start_loc[r]..[r+1]` at positions
`seq_lens[r] - q_len .. seq_lens[r] - 1` and sees keys at positions `<=` its own (causal),
`> q_pos - window` with a sliding window; scores are `c * tanh(s / c)` with a softcap `c`.

Work split: one program per (query tile, kv head). A tile is up to BLOCK_Q consecutive query
tokens of one request; request r owns tile ids `query_start_loc[r] // BLOCK_Q + r` onwards,
which grow strictly with r, so a program finds its request by counting, and the grid
(`num_tokens // BLOCK_Q + num_reqs`) is known without reading device data. A program holds
every query head of its kv head's group for each token of the tile as the rows of one
`[BLOCK_Q * GROUP_PAD, HEAD_PAD]` matrix, so each K/V tile it gathers serves the whole group.
Rows with q_len 0 launch one program that exits at once.

Split-KV (flash-decoding): a third grid axis cuts each program's keys into `num_splits`
segments of whole key tiles. Each program then writes its rows' running max, sum and
unnormalized output in fp32, and `_merge_splits_kernel` combines the segments of every
(token, head). A decode batch of a model with one KV head fills a large GPU this way, where
one program per (request, kv head) would leave most of it idle. The split count is a launch
dimension and a runtime value, never a constexpr, so it compiles no new variant.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vserve.attention.base import AttentionLayerSpec


@triton.jit
def _tile_request(qsl_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr):
    # A vector count instead of a binary search: no scalar loop-carried state, and the
    # query_start_loc row is tiny and cached.
    count = tl.zeros([BLOCK_R], dtype=tl.int32)
    for base in range(0, num_reqs, BLOCK_R):
        r = base + tl.arange(0, BLOCK_R)
        in_batch = r < num_reqs
        first_tile = tl.load(qsl_ptr + r, mask=in_batch, other=0) // BLOCK_Q + r
        count += ((first_tile <= tile) & in_batch).to(tl.int32)
    return tl.sum(count, axis=0) - 1


@triton.jit
def _tanh(x):
    # exp-based so the interpreter and every backend share one formula; exp(-2|x|) <= 1
    # never overflows, so large scores saturate cleanly to +-1.
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # The interpreter multiplies bf16 as raw uint16 bits; operands widened to fp32 after
    # rounding to the input type give the products a bf16 tensor-core MMA gives.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


# the batch's size and block-table width change every step, the window from layer to layer:
# one compiled variant serves them all (csrc_triton/variants.py)
@triton.jit(do_not_specialize=["stride_bt", "num_reqs", "window", "stride_ps", "stride_ms"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,  # q/out [T, H, D]; k/v [num_blocks, bs, Hkv, D]
    part_ptr,
    m_ptr,
    l_ptr,  # split partials: out [S, T, H, D]; max and sum [S, T, H], all fp32
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,  # [R + 1], [R], [R, max_blocks]
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_ps,
    stride_ms,
    num_reqs,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _tile_request(qsl_ptr, tile, num_reqs, BLOCK_Q, BLOCK_R)
    q_begin = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_begin
    tile_start = (tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len  # position of the request's first query token

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_PAD  # token index inside the request's query
    head_in_group = rows % GROUP_PAD
    row_valid = (tok < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = ctx_start + tok
    token = (q_begin + tok).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_DIM
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )

    # Keys past the tile's last query position are never visible; with a window, neither
    # are those before the first query's window.
    kv_hi = tl.minimum(seq_len, ctx_start + tile_start + BLOCK_Q)
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_start + tile_start - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        kv_lo = 0
    if SPLIT:  # this program's segment: whole key tiles, the last segments may be empty
        per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + tl.program_id(2) * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_hi)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_hi
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_off = block * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = n_valid[:, None] & d_valid[None, :]
        kv_ptrs = kv_off[:, None] + d[None, :] * stride_kd
        k = tl.load(k_ptr + kv_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
        v = tl.load(v_ptr + kv_ptrs, mask=kv_mask, other=0.0)

        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - n[None, :] < window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps -inf; shift by 0 so exp gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    if SPLIT:
        split = tl.program_id(2)
        row = token * (tl.num_programs(1) * GROUP) + head  # (token, head) in [T, H]
        tl.store(part_ptr + split * stride_ps + row[:, None] * HEAD_DIM + d[None, :], acc, q_mask)
        tl.store(m_ptr + split * stride_ms + row, m_i, mask=row_valid)
        tl.store(l_ptr + split * stride_ms + row, l_i, mask=row_valid)
        return
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ms"])
def _merge_splits_kernel(
    part_ptr,
    m_ptr,
    l_ptr,  # out [S, T, H, D]; max and sum [S, T, H], all fp32
    out_ptr,  # [T, H, D]
    num_splits,
    stride_ps,
    stride_ms,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * tl.num_programs(1) + head
    s = tl.arange(0, SPLIT_PAD)
    s_valid = s < num_splits
    m = tl.load(m_ptr + s * stride_ms + row, mask=s_valid, other=float("-inf"))
    l_s = tl.load(l_ptr + s * stride_ms + row, mask=s_valid, other=0.0)
    m_max = tl.max(m, axis=0)
    # a segment that saw no key holds -inf: weight 0
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(w * l_s, axis=0)
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_DIM
    part = tl.load(
        part_ptr + s[:, None] * stride_ps + row * HEAD_DIM + d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 512  # below this a split's partials cost more than its keys


@functools.cache
def _multiprocessors(device: torch.device) -> int | None:
    """The device's streaming multiprocessors (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(live_programs: int, max_seq_len: int | None, multiprocessors: int | None) -> int:
    """Key segments per program: enough for two programs per multiprocessor, each segment
    at least MIN_KEYS_PER_SPLIT keys of the longest context, at most MAX_SPLITS. 1 where
    the device has no multiprocessors to fill (the CPU's interpreter)."""
    if not multiprocessors or not max_seq_len or live_programs <= 0:
        return 1
    by_fill = -(-2 * multiprocessors // live_programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(MAX_SPLITS, by_fill, by_length))


# The decorator picked the interpreter from TRITON_INTERPRET when this module was imported.
_INTERPRETED = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _tiles(group: int, max_query_len: int | None) -> tuple[int, int]:
    """(GROUP_PAD, BLOCK_Q): rows per program are BLOCK_Q * GROUP_PAD, at least 16 for
    tl.dot; decode-only batches take the small tile so one-token rows waste less."""
    group_pad = triton.next_power_of_2(group)
    rows = 16 if max_query_len is not None and max_query_len <= 1 else 64
    rows = max(rows, group_pad)
    return group_pad, rows // group_pad


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length including this step
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    spec: AttentionLayerSpec,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """num_splits: key segments per program (None: `choose_splits` from the batch's shape
    and the device; any count gives the same result up to fp32 rounding)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0, "query heads must split evenly over kv heads"
    group = num_heads // num_kv_heads
    group_pad, block_q = _tiles(group, max_query_len)
    num_reqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out.view(num_tokens, -1)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if num_splits is None:
        # live programs: one per request in a decode batch, about one per tile otherwise
        tiles = num_reqs if max_query_len == 1 else -(-num_tokens // block_q)
        sms = _multiprocessors(query.device)
        num_splits = choose_splits(tiles * num_kv_heads, max_seq_len, sms)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} outside 1..{MAX_SPLITS}"
    split = num_splits > 1
    if split:
        # three allocations, each 16-byte aligned (a view at an offset of the batch's size
        # would change its alignment class from step to step: a new variant)
        rows = (num_splits, num_tokens, num_heads)
        part = torch.empty((*rows, head_dim), dtype=torch.float32, device=out.device)
        m = torch.empty(rows, dtype=torch.float32, device=out.device)
        l_sum = torch.empty(rows, dtype=torch.float32, device=out.device)
    else:
        part = m = l_sum = out  # not read
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        part,
        m,
        l_sum,
        query_start_loc,
        seq_lens,
        block_tables,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.stride(3),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_tokens * num_heads * head_dim,
        num_tokens * num_heads,
        num_reqs,
        float(spec.scale),
        float(spec.logit_softcap or 1.0),
        int(spec.sliding_window or 0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad,
        BLOCK_N=32,
        BLOCK_R=128,  # one width for every batch size: one variant
        HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        USE_WINDOW=spec.sliding_window is not None,
        USE_SOFTCAP=spec.logit_softcap is not None,
        # tf32 would cost fp32 inputs ~1e-3 relative error; half types ignore the setting.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_INTERPRETED and query.dtype == torch.bfloat16,
        SPLIT=split,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part,
            m,
            l_sum,
            out,
            num_splits,
            num_tokens * num_heads * head_dim,
            num_tokens * num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
            SPLIT_PAD=MAX_SPLITS,
        )
    return out.view(num_tokens, -1)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    spec: AttentionLayerSpec,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """Same contract as `paged_attention`, one request at a time in fp32 (syncs the host);
    the launch hints (max lengths, splits) do not change its result."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    flat_k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)
    flat_v = kv_cache[1].reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q = query[qsl[r] : qsl[r + 1]].float()
        if q.shape[0] == 0:
            continue
        k_pos = torch.arange(seq_len, device=query.device)
        slots = block_tables[r, k_pos // block_size].long() * block_size + k_pos % block_size
        k = flat_k[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = flat_v[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
        if spec.logit_softcap is not None:
            scores = spec.logit_softcap * torch.tanh(scores / spec.logit_softcap)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if spec.sliding_window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < spec.sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        out[qsl[r] : qsl[r + 1]] = o.to(query.dtype)
    return out.view(num_tokens, -1)
