"""Embeddings in the scheduler: the pooled sums that a request's prefill chunks return
(`RunnerOutput.pooled`, from `workers/pooling.py`) added up, and the vector sent with its
output: the last prompt token's hidden state ("last") or their mean over the prompt ("mean").
"""

from __future__ import annotations

import numpy as np

from vserve.core.request import Request


def add_pooled(req: Request, count: int, total: bytes) -> None:
    """One chunk's rows: their count and fp32 sum."""
    vector = np.frombuffer(total, dtype="<f4").astype(np.float64)
    req.pool_sum = vector if req.pool_sum is None else req.pool_sum + vector
    req.pool_count += count


def reset_pooled(req: Request) -> None:
    """A preempted request computes its prompt again: its sums start again."""
    req.pool_sum, req.pool_count = None, 0


def pooled_vector(req: Request) -> tuple[bytes | None, str | None]:
    """The finished request's vector (fp32, little-endian), or why there is none."""
    pooling = req.sampling_params.pooling
    wanted = 1 if pooling == "last" else req.num_prompt_tokens
    if req.pool_sum is None or req.pool_count != wanted:
        return None, f"pooled {req.pool_count} of the prompt's {wanted} positions"
    return (req.pool_sum / req.pool_count).astype("<f4").tobytes(), None
