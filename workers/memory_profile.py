"""What a step needs beside the KV cache, measured before the cache is sized, and the dummy
steps that measure it.

On CUDA the cache takes what is left under `gpu_memory_utilization` once the weights, the
runtime and the steps' peak are counted. The runner runs dummy steps over a scratch cache
(`profile_batches`) and reads the allocator's peak over all of them: the largest is a forward
of `max_num_batched_tokens` tokens with a sampler run of `max_num_seqs` rows sampled the
costliest way (logprobs, penalties and a bias copy the logits in fp32: several GB at 256 x
262k). Logits rows past `max_num_seqs` (n-gram drafts, prompt logprobs' chunks) are not in
it. The same steps, built through the runner's own input preparation, compile every Triton
variant a serving run meets (input preparation, prefill, mixed and decode tiles, split-KV and
not, both sampling kernels) before the engine says it is ready; the decode graphs' capture
adds none.

Every dummy row reads the same scratch blocks (a block table may point any row anywhere; a
dummy's writes land in scratch the real cache never sees), so the scratch holds one longest
context, not one per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vserve.workers.input_prep import HostInputs
from vserve.workers.sampler import SamplingMetadata


@dataclass(frozen=True)
class DummyBatch:
    """q_lens[i] tokens queried at the end of a context of ctx_lens[i] tokens."""

    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]


WARM_CONTEXT = 4096  # long enough to split the keys (csrc_triton/paged_attention.py)


def profile_batches(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[DummyBatch]:
    """The largest step (every token budgeted, as few rows as the length allows, sampled the
    costliest way), then batches that also warm up every Triton variant a run meets: mixed
    and decode, small and full, at a long context (split-KV) and at a short one (not)."""
    tokens = max(1, min(max_num_batched_tokens, max_num_seqs * max_model_len))
    rows = min(max_num_seqs, -(-tokens // max_model_len))
    q_lens = tuple(tokens // rows + (i < tokens % rows) for i in range(rows))
    long = min(max_model_len, WARM_CONTEXT)
    chunk = min(8, long)
    return [
        DummyBatch("largest step", q_lens, q_lens),
        DummyBatch("mixed, small", (chunk, 1), (long, long)),
        DummyBatch("mixed, short", (chunk, 1), (chunk, 1)),  # never split
        DummyBatch("decode, small", (1,), (long,)),
        DummyBatch("decode, full", (1,) * max_num_seqs, (long,) * max_num_seqs),
        DummyBatch("decode, short", (1,) * max_num_seqs, (1,) * max_num_seqs),  # never split
    ]


def scratch_blocks(batches, block_size: int) -> int:
    """Blocks a scratch cache needs for these batches (one longest context, plus one)."""
    longest = max(max(b.ctx_lens) for b in batches)
    return -(-longest // block_size) + 1


def dummy_host_inputs(batch: DummyBatch, block_size: int) -> HostInputs:
    """The host's view of `batch` over a scratch cache: every row's table is blocks 0, 1, 2,
    ..., so a token's slot is its position; token ids 0."""
    positions = np.concatenate(
        [np.arange(c - q, c, dtype=np.int64) for q, c in zip(batch.q_lens, batch.ctx_lens)]
    )
    max_blocks = -(-max(batch.ctx_lens) // block_size)
    ctx, q = np.array(batch.ctx_lens, dtype=np.int64), np.array(batch.q_lens, dtype=np.int64)
    return HostInputs(
        query_start_loc=np.concatenate([[0], np.cumsum(q)]).astype(np.int64),
        num_computed=ctx - q,
        positions=positions,
        seq_lens=ctx,
        block_tables=np.tile(np.arange(max_blocks, dtype=np.int32), (len(q), 1)),
        host_tokens=np.zeros(len(positions), dtype=np.int64),
        block_size=block_size,
    )


def peak_bytes(run: Callable[[], None], device: torch.device) -> int:
    """Bytes the allocator held at its peak during `run` above what it held before (CUDA);
    0 where the device keeps no such count (the CPU: its KV budget is a ceiling, not a share
    of a fixed memory)."""
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def kv_budget(total: int, utilization: float, used: int, step_peak: int) -> int:
    """Bytes the KV cache may take: `utilization` of the device's memory, less what is in use
    (weights, runtime, other processes) and the dummy steps' peak."""
    return max(0, int(total * utilization) - used - step_peak)


def dummy_sampling(rows: int, costliest: bool = False) -> SamplingMetadata:
    """Sampling metadata of `rows` rows at temperature 1, top-k and top-p on every other row
    (so both Triton sampling kernels run), and with `costliest` everything that copies the
    logits in fp32 (20 logprobs, penalties, a bias): together the two meet each kernel over
    the raw logits and over an fp32 copy."""

    def column(value):
        return [value] * rows

    return SamplingMetadata(
        temperature=column(1.0),
        top_k=[50 if i % 2 == 0 else 0 for i in range(rows)],
        top_p=[0.9 if i % 2 == 0 else 1.0 for i in range(rows)],
        min_p=column(0.0),
        seeds=list(range(rows)),
        positions=column(0),
        num_logprobs=column(20 if costliest else None),
        logit_bias=column({0: 1.0} if costliest else None),
        masked_ids=column(None),
        presence=column(0.5 if costliest else 0.0),
        frequency=column(0.5 if costliest else 0.0),
        repetition=column(1.1 if costliest else 1.0),
        prompt_ids=[[0] for _ in range(rows)] if costliest else None,
        output_ids=[[0] for _ in range(rows)] if costliest else None,
    )
