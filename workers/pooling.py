"""Embeddings (`SamplingParams.pooling`): a request's prompt hidden states (the last layer's,
after the final norm) pooled into one vector, on the last PP stage, chunk by chunk.

"mean" sums every prompt position's row; "last" takes the row of the prompt's last token. Each
step returns, per such request, the fp32 sum of the rows it computed and their count; the
scheduler adds the chunks up (`core/pooling.py`) and sends the vector with the request's one
sampled token. A preempted request starts its sum again (its steps in flight are dropped by
their epoch), and "mean" takes no prefix-cache hit, so every position is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vserve.workers.input_batch import InputBatch


@dataclass
class PoolSlice:
    req_id: str
    first: int  # hidden row of the first position pooled
    count: int  # rows pooled


def plan_pooling(
    wanted: set[str],
    batch: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    query_start_loc: np.ndarray,
    num_computed: np.ndarray,
    seq_lens: np.ndarray,
) -> list[PoolSlice]:
    """The hidden rows of this step that each request in `wanted` pools."""
    slices = []
    for i, req_id in enumerate(req_ids):
        if req_id not in wanted:
            continue
        state = batch.rows[int(rows[i])]
        start, end = int(num_computed[i]), min(int(seq_lens[i]), state.num_prompt_tokens)
        if state.sampling_params.pooling == "last":
            start = max(start, state.num_prompt_tokens - 1)
        if end > start:
            slices.append(
                PoolSlice(
                    req_id, int(query_start_loc[i]) + start - int(num_computed[i]), end - start
                )
            )
    return slices


def compute_pooling(hidden: torch.Tensor, slices: list[PoolSlice]) -> dict[str, tuple[int, bytes]]:
    """hidden: [num_tokens, hidden] of the step -> req id -> (rows pooled, their fp32 sum)."""
    out = {}
    for s in slices:
        total = hidden[s.first : s.first + s.count].float().sum(0)
        out[s.req_id] = (s.count, total.cpu().numpy().astype("<f4").tobytes())
    return out
