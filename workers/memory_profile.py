"""What a step needs beside the KV cache, measured before the cache is sized, and the dummy
batches that measure it.

On CUDA the cache takes what is left under `gpu_memory_utilization` once the weights, the
runtime and the largest step's activations and sampler temporaries are counted. The largest
step is a forward of `max_num_batched_tokens` tokens and a sampler run of `max_num_seqs` rows
at temperature 1 (fp32 copies of a [rows, vocab] tensor: about 2 GB at 256 x 262k), so the
runner runs both once over a scratch cache (`profile_batches`) and reads the allocator's peak.
The same launches compile the Triton variants a serving run meets (prefill and mixed tiles,
split-KV and not) before the engine says it is ready; the decode graphs' capture compiles the
decode ones.

Every dummy row reads the same scratch blocks (a block table may point any row anywhere; a
dummy's writes land in scratch the real cache never sees), so the scratch holds one longest
context, not one per row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vserve.attention.base import AttentionMetadata
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
    """The largest step (every token budgeted, as few rows as the length allows), whose peak
    is measured; then batches that only warm up: small and full mixed and decode batches at a
    long context (split-KV) and a full one at a short context (not split)."""
    tokens = max(1, min(max_num_batched_tokens, max_num_seqs * max_model_len))
    rows = min(max_num_seqs, -(-tokens // max_model_len))
    q_lens = tuple(tokens // rows + (i < tokens % rows) for i in range(rows))
    long = min(max_model_len, WARM_CONTEXT)
    chunk = min(8, long)
    return [
        DummyBatch("largest step", q_lens, q_lens),
        DummyBatch("mixed, small", (chunk, 1), (long, long)),
        DummyBatch("decode, small", (1,), (long,)),
        DummyBatch("decode, full", (1,) * max_num_seqs, (long,) * max_num_seqs),
        DummyBatch("decode, short", (1,) * max_num_seqs, (1,) * max_num_seqs),  # never split
    ]


def scratch_blocks(batches, block_size: int) -> int:
    """Blocks a scratch cache needs for these batches (one longest context, plus one)."""
    longest = max(max(b.ctx_lens) for b in batches)
    return -(-longest // block_size) + 1


def dummy_metadata(batch: DummyBatch, block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata of `batch` over a scratch cache: every row's table is blocks 0, 1, 2, ..."""
    qsl = [0, *itertools.accumulate(batch.q_lens)]
    max_blocks = -(-max(batch.ctx_lens) // block_size)
    positions = torch.cat(
        [torch.arange(c - q, c, dtype=torch.int64) for q, c in zip(batch.q_lens, batch.ctx_lens)]
    )
    table = torch.arange(max_blocks, dtype=torch.int32)
    int32 = {"dtype": torch.int32, "device": device}
    return AttentionMetadata(
        num_tokens=qsl[-1],
        positions=positions.to(device),
        slot_mapping=positions.to(device),  # block i of every table is block i: slot = position
        query_start_loc=torch.tensor(qsl, **int32),
        seq_lens=torch.tensor(batch.ctx_lens, **int32),
        block_tables=table.expand(len(batch.q_lens), max_blocks).contiguous().to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(batch.ctx_lens),
        max_query_len=max(batch.q_lens),
        max_seq_len=max(batch.ctx_lens),
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
    (weights, runtime, other processes) and the largest step's peak."""
    return max(0, int(total * utilization) - used - step_peak)


def dummy_sampling(rows: int):
    """Sampling metadata of `rows` rows at temperature 1, no filters: the default path."""

    def column(value):
        return [value] * rows

    return SamplingMetadata(
        temperature=column(1.0),
        top_k=column(0),
        top_p=column(1.0),
        min_p=column(0.0),
        seeds=list(range(rows)),
        positions=column(0),
        num_logprobs=column(None),
        logit_bias=column(None),
        masked_ids=column(None),
        presence=column(0.0),
        frequency=column(0.0),
        repetition=column(1.0),
    )
