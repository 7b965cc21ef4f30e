"""The persistent batch: one row per request the worker holds, kept across steps.

Rows hold token ids (with -1 for tokens this worker sampled but has not yet copied back to
the host), counts, block tables (one per KV group: full attention, then sliding window, where
-1 marks a block that left the window) and sampling parameters. Each step only deltas arrive: new
requests fill the lowest free rows; finished and preempted ones leave holes that `condense()`
fills by moving the highest rows down. Rows are keyed by request id *and* epoch, so a request
that was preempted and re-admitted is a different row state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vserve.core.sched_output import NewRequestData
from vserve.sampling_params import SamplingParams


@dataclass
class RowState:
    req_id: str
    epoch: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sampling_seed: int
    stop_token_ids: list[int]


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, num_kv_groups: int = 1
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.full((max_num_reqs, max_model_len), -1, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known + placeholders
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [
            np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
            for _ in range(num_kv_groups)
        ]
        self.block_table = self.block_tables[0]  # the full-attention group's
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.epochs = np.zeros(max_num_reqs, dtype=np.int64)  # of each row's request
        self.rows: list[RowState | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self.num_rows = 0  # rows [0, num_rows) may be occupied (holes until condense)
        self.layout_version = 0  # bumped whenever a row gets, loses or changes its request

    # -- membership ------------------------------------------------------------------------------
    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def add(self, new: NewRequestData) -> int:
        row = next(i for i in range(self.max_num_reqs) if self.rows[i] is None)
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.token_ids[row, n:] = -1
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self.rows[row] = RowState(
            new.req_id,
            new.epoch,
            new.num_prompt_tokens,
            new.sampling_params,
            new.sampling_seed,
            new.stop_token_ids,
        )
        self.epochs[row] = new.epoch
        self.layout_version += 1
        self.row_of[new.req_id] = row
        self.num_rows = max(self.num_rows, row + 1)
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.rows[row] = None
            self.layout_version += 1

    def condense(self) -> None:
        """Move the highest occupied rows into the lowest holes."""
        low, high = 0, self.num_rows - 1
        while True:
            while low <= high and self.rows[low] is not None:
                low += 1
            while high >= low and self.rows[high] is None:
                high -= 1
            if low >= high:
                break
            self._move(high, low)
        self.num_rows = len(self.row_of)

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.token_ids[dst, n:] = -1
        for arr in (self.num_tokens, self.num_computed, self.num_blocks, self.epochs):
            arr[dst] = arr[src]
        for table in self.block_tables:
            table[dst] = table[src]
        self.rows[dst], self.rows[src] = self.rows[src], None
        self.layout_version += 1
        self.row_of[self.rows[dst].req_id] = dst

    # -- per step updates ------------------------------------------------------------------------
    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """New blocks of each KV group (the groups hold the same number of entries)."""
        if block_ids[0]:
            start, n = self.num_blocks[row], len(block_ids[0])
            for table, ids in zip(self.block_tables, block_ids, strict=True):
                table[row, start : start + n] = ids
            self.num_blocks[row] = start + n

    def append_placeholder(self, row: int) -> int:
        """Reserve the next position for a token this step samples; returns the position."""
        pos = int(self.num_tokens[row])
        self.token_ids[row, pos] = -1
        self.num_tokens[row] = pos + 1
        return pos

    def append_placeholders(self, rows: np.ndarray) -> None:
        """`append_placeholder` for each of `rows` (distinct)."""
        self.token_ids[rows, self.num_tokens[rows]] = -1
        self.num_tokens[rows] += 1

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Ids already on the host (verified drafts): they take the next positions."""
        pos = int(self.num_tokens[row])
        self.token_ids[row, pos : pos + len(token_ids)] = token_ids
        self.num_tokens[row] = pos + len(token_ids)

    def write_token(self, req_id: str, epoch: int, position: int, token_id: int) -> None:
        """Fill a placeholder once its sampled id reached the host (if the row still lives)."""
        row = self.row_of.get(req_id)
        if row is not None and self.rows[row].epoch == epoch:
            self.token_ids[row, position] = token_id

    def output_ids(self, row: int) -> list[int]:
        state = self.rows[row]
        return self.token_ids[row, state.num_prompt_tokens : self.num_tokens[row]].tolist()

    def prompt_ids(self, row: int) -> list[int]:
        return self.token_ids[row, : self.rows[row].num_prompt_tokens].tolist()
