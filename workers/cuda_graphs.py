"""CUDA graphs for decode batches: captured once at start-up, replayed by every step whose
rows each carry exactly one query token.

A decode step is dozens of small kernel launches per layer; replaying a captured graph turns
them into one launch, so the host no longer paces the GPU. Graphs are captured for a ladder of
padded batch sizes (`capture_sizes`) after the KV cache exists, largest first so the smaller
graphs reuse the largest one's memory pool. At run time a batch of n rows goes to the smallest
captured size s >= n (`padded_size`): its inputs are copied into static buffers shared by every
graph (the graph of size s reads their first s rows), the graph replays, and rows [0, n) of the
graph's static output are the batch's hidden states. Everything else (prefills, mixed batches,
the torch backend, pipeline stages, `--enforce-eager`) runs eagerly.

Padding rows must be inert for any graph that reads them:

| static buffer   | rows [0, n)       | padding rows [n, s)                               |
|-----------------|-------------------|---------------------------------------------------|
| input_ids       | the step's ids    | 0                                                 |
| positions       | the step's        | 0                                                 |
| slot_mapping    | the step's slots  | -1: the KV write skips them, live blocks are safe |
| query_start_loc | arange: one token per row, set once, never copied                     |
| seq_lens        | the step's        | 1: attention reads one valid key, no NaN          |
| block_tables    | the step's        | block 0                                           |

Rows past the last batch's n are kept inert, so a smaller batch resets only the rows the
previous, larger batch used.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from vserve.attention.base import AttentionMetadata

logger = logging.getLogger("vserve.worker")


def use_cuda_graphs(
    device: str, attention_backend: str, enforce_eager: bool, pp_size: int, tp_size: int = 1
) -> bool:
    """Graphs need CUDA and the graph-safe Triton backend (the torch backend builds per-step
    index tensors on the host); pipeline stages exchange hidden states eagerly, and tensor
    parallel ranks all-reduce eagerly too (NCCL inside a captured graph is not yet tested)."""
    return (
        torch.device(device).type == "cuda"
        and attention_backend == "triton"
        and not enforce_eager
        and pp_size == 1
        and tp_size == 1
    )


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, then max_num_seqs itself (ascending): padding stays
    under 8 rows for large batches while the number of graphs stays small."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_reqs rows, or None when none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def is_decode_batch(meta: AttentionMetadata) -> bool:
    """Every row has exactly one query token (no prefill chunk, no empty row)."""
    return meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs


class DecodeBuffers:
    """The static inputs every captured graph reads; device-agnostic, so tested on CPU."""

    def __init__(self, max_size: int, max_blocks: int, device: torch.device) -> None:
        long = {"dtype": torch.int64, "device": device}
        int32 = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(max_size, **long)  # [max_size]
        self.positions = torch.zeros(max_size, **long)  # [max_size]
        self.slot_mapping = torch.full((max_size,), -1, **long)  # [max_size]
        self.query_start_loc = torch.arange(max_size + 1, **int32)  # [max_size + 1]
        self.seq_lens = torch.ones(max_size, **int32)  # [max_size]
        self.block_tables = torch.zeros(max_size, max_blocks, **int32)  # [max_size, mb]
        self.num_live = 0  # rows [0, num_live) may hold a real batch; the rest are inert

    def meta(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """Metadata over the first `size` rows, as a graph of that size captures it. Host
        fields are placeholders: a graph never reads the host, so max_query_len is 1."""
        return AttentionMetadata(
            num_tokens=size,
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )

    def load(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a decode batch into rows [0, n); make the rows the last batch left inert."""
        n = meta.num_tokens
        num_blocks = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # columns past num_blocks keep stale ids; seq_lens keeps attention from reading them
        self.block_tables[:n, :num_blocks].copy_(meta.block_tables)
        if self.num_live > n:
            self.input_ids[n : self.num_live].zero_()
            self.positions[n : self.num_live].zero_()
            self.slot_mapping[n : self.num_live].fill_(-1)
            self.seq_lens[n : self.num_live].fill_(1)
            self.block_tables[n : self.num_live].zero_()
        self.num_live = n


class DecodeGraphs:
    """The captured decode graphs of one model runner and their static buffers."""

    def __init__(
        self,
        model,
        kv_caches: list,
        backend,
        windows: set,
        max_num_seqs: int,
        max_blocks: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.windows, self.max_model_len, self.device = windows, max_model_len, device
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden] static output
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self.buffers.meta(size, self.max_model_len)
            meta.backend_data = self.backend.prepare(meta, self.windows)
            self.metas[size] = meta
            # Warm-up outside the graph: Triton compiles each kernel variant here, never
            # during capture. All slots are -1, so neither pass writes the KV cache.
            self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "Captured CUDA graphs for decode batch sizes %s in %.2f s.",
            self.sizes,
            time.perf_counter() - start,
        )

    def _forward(self, size: int) -> torch.Tensor:
        meta = self.metas[size]
        return self.model(
            self.buffers.input_ids[:size], meta.positions, self.kv_caches, meta, self.backend
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A decode batch that fits, with one KV group (the buffers hold one set of tables; a
        sliding-window group comes with the torch backend only, which graphs never use)."""
        return (
            is_decode_batch(meta)
            and meta.num_reqs <= self.sizes[-1]
            and meta.local_block_tables is None
        )

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [n] -> hidden states [n, hidden], a view of the graph's static output
        (valid until the next replay; later kernels on the same stream read it first)."""
        n = meta.num_tokens
        size = padded_size(n, self.sizes)
        self.buffers.load(input_ids, meta)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]
