"""Fused per-step input preparation for async scheduling.

Owns the Triton kernel `prepare_inputs` and its torch reference `prepare_inputs_reference`.
With overlap scheduling the host builds step N+1 before step N's samples are back, so the
token a decode row feeds in is unknown to the host (`host_tokens` holds -1 there) and still
sits on the device in `prev_sampled`. One launch turns the host's view plus that device
feedback into the step's `input_ids`, `positions` and `slot_mapping`, with no host sync.

One program per request row; one extra program fills tokens past `query_start_loc[-1]`
(padding up to a captured batch size) with id 0, position 0 and slot -1, which the KV write
skips. Positions whose block index is past the block table also get slot -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 64  # query tokens per loop step of a row


@triton.jit
def _fill_row(
    row,
    qsl_ptr,
    num_computed_ptr,
    bt_ptr,
    stride_bt,
    max_blocks,
    host_ptr,
    prev_ptr,
    prev_index_ptr,
    fb_offset_ptr,
    ids_ptr,
    pos_ptr,
    slot_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - start
    computed = tl.load(num_computed_ptr + row).to(tl.int64)
    prev_index = tl.load(prev_index_ptr + row)
    has_feedback = prev_index >= 0
    feedback_at = tl.load(fb_offset_ptr + row)
    feedback = tl.load(prev_ptr + tl.maximum(prev_index, 0), mask=has_feedback, other=0)
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt
    for base in range(0, q_len, BLOCK):
        j = base + tl.arange(0, BLOCK)
        in_row = j < q_len
        pos = computed + j
        block_idx = pos // BLOCK_SIZE
        in_table = in_row & (block_idx < max_blocks)
        block = tl.load(bt_row + block_idx, mask=in_table, other=0).to(tl.int64)
        slot = tl.where(in_table, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
        # Feedback is merged in registers rather than stored after the loop: a later scalar
        # store from the same program is not ordered after other threads' vector stores.
        ids = tl.load(host_ptr + start + j, mask=in_row, other=0)
        ids = tl.where(has_feedback & (j == feedback_at), feedback, ids)
        tl.store(ids_ptr + start + j, ids, mask=in_row)
        tl.store(pos_ptr + start + j, pos, mask=in_row)
        tl.store(slot_ptr + start + j, slot, mask=in_row)


@triton.jit
def _fill_padding(first, num_tokens, ids_ptr, pos_ptr, slot_ptr, BLOCK: tl.constexpr):
    for base in range(first, num_tokens, BLOCK):
        t = base + tl.arange(0, BLOCK)
        pad = t < num_tokens
        zero = tl.zeros([BLOCK], dtype=tl.int64)
        tl.store(ids_ptr + t, zero, mask=pad)
        tl.store(pos_ptr + t, zero, mask=pad)
        tl.store(slot_ptr + t, zero - 1, mask=pad)


# the batch's sizes change every step: one compiled variant serves them all
# (csrc_triton/variants.py)
@triton.jit(do_not_specialize=["stride_bt", "max_blocks", "num_reqs", "num_tokens"])
def _prepare_inputs_kernel(
    qsl_ptr,
    num_computed_ptr,
    bt_ptr,
    stride_bt,
    max_blocks,
    host_ptr,
    prev_ptr,
    prev_index_ptr,
    fb_offset_ptr,
    ids_ptr,
    pos_ptr,
    slot_ptr,
    num_reqs,
    num_tokens,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    if row < num_reqs:
        _fill_row(
            row,
            qsl_ptr,
            num_computed_ptr,
            bt_ptr,
            stride_bt,
            max_blocks,
            host_ptr,
            prev_ptr,
            prev_index_ptr,
            fb_offset_ptr,
            ids_ptr,
            pos_ptr,
            slot_ptr,
            BLOCK_SIZE,
            BLOCK,
        )
    else:
        _fill_padding(tl.load(qsl_ptr + num_reqs), num_tokens, ids_ptr, pos_ptr, slot_ptr, BLOCK)


def prepare_inputs(
    query_start_loc: torch.Tensor,  # [R + 1] int32
    num_computed: torch.Tensor,  # [R] int64, tokens in the KV cache before this step
    block_table: torch.Tensor,  # [R, max_blocks] int32
    block_size: int,
    host_tokens: torch.Tensor,  # [T] int64, -1 where the host does not know the id
    prev_sampled: torch.Tensor,  # [P] int64, ids sampled by the previous step
    prev_index: torch.Tensor,  # [R] int32, index into prev_sampled, -1 = none
    feedback_offset: torch.Tensor,  # [R] int32, query offset the fed-back id goes to
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # input_ids, positions, slots [T]
    num_tokens = host_tokens.shape[0]
    num_reqs = query_start_loc.shape[0] - 1
    device = host_tokens.device
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=device)
    if prev_sampled.numel() == 0:  # keep a valid pointer; no row can index it
        prev_sampled = torch.zeros(1, dtype=torch.int64, device=device)
    _prepare_inputs_kernel[(num_reqs + 1,)](
        query_start_loc,
        num_computed,
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        host_tokens,
        prev_sampled,
        prev_index,
        feedback_offset,
        input_ids,
        positions,
        slot_mapping,
        num_reqs,
        num_tokens,
        BLOCK_SIZE=block_size,
        BLOCK=_BLOCK,
    )
    return input_ids, positions, slot_mapping


def prepare_inputs_reference(
    query_start_loc: torch.Tensor,
    num_computed: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    host_tokens: torch.Tensor,
    prev_sampled: torch.Tensor,
    prev_index: torch.Tensor,
    feedback_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `prepare_inputs` in plain torch (syncs the host)."""
    num_tokens = host_tokens.shape[0]
    device = host_tokens.device
    qsl = query_start_loc.long()
    used = int(qsl[-1])
    row = torch.repeat_interleave(torch.arange(qsl.numel() - 1, device=device), qsl.diff())
    j = torch.arange(used, device=device) - qsl[row]
    pos = num_computed.long()[row] + j
    block_idx = pos // block_size
    in_table = block_idx < block_table.shape[1]
    block = block_table[row, block_idx.clamp(max=block_table.shape[1] - 1)].long()
    slot = torch.where(in_table, block * block_size + pos % block_size, -1)

    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    input_ids[:used] = host_tokens[:used]
    positions[:used] = pos
    slot_mapping[:used] = slot
    # An offset outside the row's query has no token to replace (the kernel never reaches it).
    fed = ((prev_index >= 0) & (feedback_offset.long() < qsl.diff())).nonzero().squeeze(1)
    input_ids[qsl[fed] + feedback_offset[fed].long()] = prev_sampled[prev_index[fed].long()]
    return input_ids, positions, slot_mapping
