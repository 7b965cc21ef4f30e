"""Prompt logprobs: for the requests that ask (`SamplingParams.prompt_logprobs = k`), the
logprob of every prompt token given the tokens before it, its rank, and the top-k, from the
raw logits of the prefill positions that predict it (vLLM's `PromptLogprobs`).

A prefill chunk computing positions [start, end) of a prompt of P tokens predicts prompt
tokens start + 1 .. min(end, P - 1); token 0 has no entry. The runner plans one slice per such
request and step (last PP stage only) and computes it from the step's hidden states, at most
`_ROWS` logits rows (and `_SLICE_BYTES` of them) at a time, so that a long chunk never holds
chunk x vocab logits at once: with a 262k vocabulary a slice and its temporaries stay near
300 MB, whatever the prompt's length.
Requests that do not ask cost one empty-set test per step. Prefix-cache hits are never taken
by these requests (the KV manager), so no position is skipped; positions a preempted request
computes again are dropped by the scheduler, which keeps what already arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vserve.core.outputs import LogprobsDelta
from vserve.workers.input_batch import InputBatch
from vserve.workers.sampler import _logprobs_torch

_ROWS = 256  # most logits rows per slice of a long chunk
_SLICE_BYTES = 64 << 20  # and at most this much fp32 logits in a slice (262k vocab: 64 rows)


@dataclass
class PromptSlice:
    req_id: str
    hidden_start: int  # hidden row of the query token at prompt position first - 1
    first: int  # prompt index of the first token predicted (>= 1)
    target_ids: list[int]  # the prompt tokens predicted, first .. first + n - 1
    num_top: int  # k


def plan_prompt_logprobs(
    wanted: set[str],
    batch: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    query_start_loc: np.ndarray,
    num_computed: np.ndarray,
    seq_lens: np.ndarray,
) -> list[PromptSlice]:
    """The slices of this step for the requests in `wanted` (scheduled or not)."""
    slices = []
    for i, req_id in enumerate(req_ids):
        if req_id not in wanted:
            continue
        row, state = int(rows[i]), batch.rows[int(rows[i])]
        start = int(num_computed[i])
        last = min(int(seq_lens[i]), state.num_prompt_tokens - 1)  # positions start..last-1
        if last <= start:
            continue
        targets = batch.token_ids[row, start + 1 : last + 1].tolist()
        slices.append(
            PromptSlice(
                req_id,
                int(query_start_loc[i]),
                start + 1,
                targets,
                state.sampling_params.prompt_logprobs,
            )
        )
    return slices


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, slices: list[PromptSlice], vocab_size: int
) -> dict[str, tuple[int, LogprobsDelta]]:
    """hidden: [num_tokens, hidden] of the step -> req id -> (first, entries)."""
    out = {}
    step = max(1, min(_ROWS, _SLICE_BYTES // (4 * vocab_size)))
    for s in slices:
        delta = LogprobsDelta([], [], [])
        for a in range(0, len(s.target_ids), step):
            targets = s.target_ids[a : a + step]
            rows = hidden[s.hidden_start + a : s.hidden_start + a + len(targets)]
            logits = model.compute_logits(rows).float()
            ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
            chosen, ranks, top_ids, top_vals = _logprobs_torch(logits, ids, s.num_top)
            top_i = top_ids.tolist() if s.num_top else [[]] * len(targets)
            top_v = top_vals.tolist() if s.num_top else [[]] * len(targets)
            for tid, val, ti, tv in zip(targets, chosen.tolist(), top_i, top_v):
                delta.token_ids.append([tid] + ti)
                delta.logprobs.append([val] + tv)
            delta.ranks += ranks.tolist()
        out[s.req_id] = (s.first, delta)
    return out
