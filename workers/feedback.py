"""On-device token feedback: the ids a step sampled stay on the device until the host has
them, and the next step reads them from there.

`FeedbackQueue` holds one `Feedback` per sampling step, oldest first. Before a step is built,
every entry older than the newest one the step reads is written back into the host rows (its
ids are there by then), and so is the oldest beyond `max_pending`; the first entry left is
planned into the step's `input_ids` on the device (`FeedbackQueue.plan`). Without PP
`max_pending` is 1: all but the newest entry are written back. On stage 0 of a pipeline the
entries are the last stage's ids, still on their way: `max_pending` is the PP degree, so a step
never waits for ids it does not read (its rows decode every `pp` steps, reading the entry `pp`
steps old; the newer ones stay pending). An id only goes where its request still lives *in the
same epoch*, so a request that was preempted and re-admitted never reads a stale id.

Each entry remembers the rows it was pushed for and the batch's `layout_version` then: while no
row has been added, removed or moved since (the common decode step), writing back and planning
are numpy operations on those rows; after a change they go request by request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from vserve.workers.device import HostCopy, upload
from vserve.workers.input_batch import InputBatch
from vserve.workers.input_prep import FeedbackPlan, HostInputs


@dataclass
class Feedback:
    """Ids sampled by one step, kept on the device until the host has them."""

    step_id: int
    token_ids: torch.Tensor | None  # [num_sampled] on the device
    req_ids: list[str]  # per id
    rows: np.ndarray  # [num_sampled] batch rows when pushed
    epochs: np.ndarray  # [num_sampled]
    positions: np.ndarray  # [num_sampled] where each id goes
    layout_version: int  # the batch's, when pushed
    host: HostCopy | None = None
    wait_fn: Callable[[], object] | None = None  # PP: waits for the ids from the last stage

    @classmethod
    def of(
        cls,
        step_id: int,
        token_ids: torch.Tensor | None,
        entries: list[tuple[str, int, int]],
        wait_fn: Callable[[], object] | None = None,
    ) -> Feedback:
        """From (req_id, epoch, position) entries with no rows: planned and written back
        request by request."""
        req_ids, epochs, positions = zip(*entries) if entries else ((), (), ())
        return cls(
            step_id,
            token_ids,
            list(req_ids),
            np.full(len(entries), -1, np.int64),
            np.array(epochs, np.int64),
            np.array(positions, np.int64),
            -1,
            wait_fn=wait_fn,
        )

    @cached_property
    def entries(self) -> list[tuple[str, int, int]]:
        """(req_id, epoch, position) per id."""
        return list(zip(self.req_ids, self.epochs.tolist(), self.positions.tolist()))

    @cached_property
    def index(self) -> dict[str, int]:
        """req_id -> index into token_ids."""
        return {req_id: j for j, req_id in enumerate(self.req_ids)}

    def rows_valid(self, batch: InputBatch) -> bool:
        """Whether `rows` still hold the same requests (no row added, removed or moved)."""
        return self.layout_version == batch.layout_version

    def device_ids(self) -> torch.Tensor:
        if self.wait_fn is not None:
            self.wait_fn()
            self.wait_fn = None
        return self.token_ids

    def host_ids(self) -> np.ndarray:
        if self.host is not None:
            return self.host.wait()[0].numpy()
        return self.device_ids().cpu().numpy()

    def feeds(self, spans: dict[str, tuple[int, int, int]]) -> bool:
        """Whether a step whose queries cover `spans` reads one of these ids."""
        for req_id, j in self.index.items():
            span = spans.get(req_id)
            if span is not None:
                _, epoch, pos = self.entries[j]
                if epoch == span[0] and span[1] <= pos < span[2]:
                    return True
        return False


class FeedbackQueue:
    def __init__(self, max_pending: int = 1) -> None:
        self.items: deque[Feedback] = deque()
        self.max_pending = max_pending

    @property
    def source(self) -> Feedback | None:
        """The entry a step reads on the device (after `settle`)."""
        return self.items[0] if self.items else None

    def push(
        self,
        step_id: int,
        batch: InputBatch,
        rows: list[int],
        req_ids: list[str],
        token_ids: torch.Tensor | None,
        wait_fn=None,
    ) -> Feedback:
        """Rows just got a placeholder each for the id `token_ids[k]` (in row order)."""
        rows = np.asarray(rows, dtype=np.int64)
        fb = Feedback(
            step_id,
            token_ids,
            list(req_ids),
            rows,
            batch.epochs[rows],
            batch.num_tokens[rows] - 1,
            batch.layout_version,
            wait_fn=wait_fn,
        )
        self.items.append(fb)
        return fb

    def flush(self, batch: InputBatch, keep_latest: bool) -> None:
        """Write ids back into the host rows (all, or all but the newest)."""
        self._write_back(batch, len(self.items) - (1 if keep_latest else 0))

    def settle(self, batch: InputBatch, spans: dict[str, tuple[int, int, int]] | None) -> None:
        """Before a step: write back every entry older than the newest one holding an id the
        step reads (`spans`: req_id -> (epoch, first, end) positions of its query), and the
        oldest ones beyond `max_pending`. `spans` may be None when `max_pending` is 1."""
        keep = len(self.items) - self.max_pending
        if self.max_pending > 1:
            for k in range(len(self.items) - 1, max(keep, -1), -1):
                if self.items[k].feeds(spans):
                    keep = k
                    break
        self._write_back(batch, keep)

    def device_ids_at(
        self, keys: list[tuple[str, int, int]]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Ids the host still lacks, for (req_id, epoch, position) keys: which keys (indices into
        `keys`) are pending here, and their ids [len(found)] gathered on the device, in that
        order. The host does not wait for the device."""
        found, parts = [], []
        for fb in self.items:
            hits = [
                (k, fb.index[key[0]])
                for k, key in enumerate(keys)
                if key[0] in fb.index and fb.entries[fb.index[key[0]]][1:] == key[1:]
            ]
            if hits:
                ids = fb.device_ids()
                found += [k for k, _ in hits]
                parts.append(ids[upload([j for _, j in hits], ids.device)])
        return found, (torch.cat(parts) if parts else None)

    def _write_back(self, batch: InputBatch, count: int) -> None:
        for _ in range(max(0, count)):
            fb = self.items.popleft()
            if fb.rows_valid(batch):
                batch.token_ids[fb.rows, fb.positions] = fb.host_ids()
                continue
            for (req_id, epoch, pos), token in zip(fb.entries, fb.host_ids().tolist()):
                batch.write_token(req_id, epoch, pos, token)

    def plan(
        self,
        batch: InputBatch,
        host: HostInputs,
        req_ids: list[str],
        rows: np.ndarray,
        poison: bool = False,
    ) -> FeedbackPlan:
        """Where the source entry's ids go; asserts that they cover every token the host lacks.
        `poison` (tests) writes garbage where the device ids will land."""
        source, plan = self.source, FeedbackPlan()
        computed, qsl = host.num_computed, host.query_start_loc
        if source is not None and source.rows_valid(batch):
            plan = _plan_rows(source, rows, computed, qsl)
            source = None  # planned
        for i, req_id in enumerate(req_ids if source is not None else ()):
            j = source.index.get(req_id)
            if j is None:
                continue
            _, epoch, pos = source.entries[j]
            offset = int(pos - computed[i])
            if epoch == batch.rows[rows[i]].epoch and 0 <= offset < qsl[i + 1] - qsl[i]:
                plan.add(i, j, offset, int(qsl[i] + offset))
        if poison and plan.dest:
            host.host_tokens[plan.dest] = 0
        unknown = host.host_tokens < 0
        unknown[plan.dest] = False
        assert not unknown.any(), "a token the host does not know was not fed back"
        return plan


def _plan_rows(
    source: Feedback, rows: np.ndarray, computed: np.ndarray, qsl: np.ndarray
) -> FeedbackPlan:
    """`FeedbackQueue.plan` while the source's rows hold the same requests (same epochs) as
    when it was pushed: match them against the step's sorted `rows` in numpy."""
    if not len(rows) or not len(source.rows):
        return FeedbackPlan()
    where = np.minimum(np.searchsorted(rows, source.rows), len(rows) - 1)
    offset = source.positions - computed[where]
    keep = (rows[where] == source.rows) & (offset >= 0) & (offset < qsl[where + 1] - qsl[where])
    src = np.flatnonzero(keep)
    src = src[np.argsort(where[src], kind="stable")]  # in the step's row order
    i = where[src]
    return FeedbackPlan(
        i.tolist(), src.tolist(), offset[src].tolist(), (qsl[i] + offset[src]).tolist()
    )
