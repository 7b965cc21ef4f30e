"""On-device token feedback: the ids a step sampled stay on the device until the host has
them, and the next step reads them from there.

`FeedbackQueue` holds one `Feedback` per sampling step, oldest first. Before a step is built,
every entry but the newest is written back into the host rows (its host copy is done by then);
the newest is planned into the step's `input_ids` on the device (`FeedbackQueue.plan`). An id
only goes where its request still lives *in the same epoch*, so a request that was preempted
and re-admitted never reads a stale id.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from workers.device import HostCopy
from workers.input_batch import InputBatch
from workers.input_prep import FeedbackPlan, HostInputs


@dataclass
class Feedback:
    """Ids sampled by one step, kept on the device until the host has them."""

    step_id: int
    token_ids: torch.Tensor | None                 # [num_sampled] on the device
    entries: list[tuple[str, int, int]]            # (req_id, epoch, position) per id
    index: dict[str, int]                          # req_id -> index into token_ids
    host: HostCopy | None = None
    wait_fn: object = None                          # PP: waits for the ids from the last stage

    def device_ids(self) -> torch.Tensor:
        if self.wait_fn is not None:
            self.wait_fn()
            self.wait_fn = None
        return self.token_ids

    def host_ids(self) -> list[int]:
        if self.host is not None:
            return self.host.wait()[0].tolist()
        return self.device_ids().tolist()


class FeedbackQueue:
    def __init__(self) -> None:
        self.items: deque[Feedback] = deque()

    @property
    def latest(self) -> Feedback | None:
        return self.items[-1] if self.items else None

    def push(self, step_id: int, batch: InputBatch, rows: list[int], req_ids: list[str],
             token_ids: torch.Tensor | None, wait_fn=None) -> Feedback:
        """Rows just got a placeholder each for the id `token_ids[k]` (in row order)."""
        entries = [(req_id, batch.rows[r].epoch, int(batch.num_tokens[r]) - 1)
                   for r, req_id in zip(rows, req_ids)]
        index = {req_id: j for j, req_id in enumerate(req_ids)}
        fb = Feedback(step_id, token_ids, entries, index, wait_fn=wait_fn)
        self.items.append(fb)
        return fb

    def flush(self, batch: InputBatch, keep_latest: bool) -> None:
        """Write ids back into the host rows (all, or all but the newest)."""
        while len(self.items) > (1 if keep_latest else 0):
            fb = self.items.popleft()
            for (req_id, epoch, pos), token in zip(fb.entries, fb.host_ids()):
                batch.write_token(req_id, epoch, pos, token)

    def plan(self, batch: InputBatch, host: HostInputs, req_ids: list[str], rows: np.ndarray,
             poison: bool = False) -> FeedbackPlan:
        """Where the newest ids go; asserts that they cover every token the host lacks.
        `poison` (tests) writes garbage where the device ids will land."""
        latest, plan = self.latest, FeedbackPlan()
        computed, qsl = host.num_computed, host.query_start_loc
        for i, req_id in enumerate(req_ids if latest is not None else ()):
            j = latest.index.get(req_id)
            if j is None:
                continue
            _, epoch, pos = latest.entries[j]
            offset = int(pos - computed[i])
            if epoch == batch.rows[rows[i]].epoch and 0 <= offset < qsl[i + 1] - qsl[i]:
                plan.add(i, j, offset, int(qsl[i] + offset))
        if poison and plan.dest:
            host.host_tokens[plan.dest] = 0
        unknown = host.host_tokens < 0
        unknown[plan.dest] = False
        assert not unknown.any(), "a token the host does not know was not fed back"
        return plan
