"""Building one step's device inputs from the host's view of the batch.

The runner gathers what the host knows (`HostInputs`: query layout, context lengths, block
tables, token ids with -1 where a sampled id has not come back yet) and decides where the
previous step's ids, still on the device, must go (`FeedbackPlan`). An `InputPrep` turns both
into `DeviceInputs`. Two strategies share that contract and are chosen once from the device:

| strategy         | device | positions / slots          | fed-back ids                       |
|------------------|--------|----------------------------|------------------------------------|
| `TorchInputPrep` | CPU    | numpy, copied              | one slice copy, else index scatter |
| `FusedInputPrep` | CUDA   | one Triton launch computes | merged by the same launch          |

The fused path copies two packed host buffers (int32, int64) instead of one tensor per field.
A sliding-window KV group's slots (`local_*`) are computed on the host by both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vserve.workers.device import DeviceShim


@dataclass
class HostInputs:
    query_start_loc: np.ndarray  # [num_reqs + 1] int64
    num_computed: np.ndarray  # [num_reqs] int64, tokens in the KV cache before this step
    positions: np.ndarray  # [num_tokens] int64
    seq_lens: np.ndarray  # [num_reqs] int64, context length after this step
    block_tables: np.ndarray  # [num_reqs, max_blocks] int32
    host_tokens: np.ndarray  # [num_tokens] int64, -1 where the host lacks the id
    block_size: int
    local_block_tables: np.ndarray | None = None  # [num_reqs, max_blocks] int32, the
    #   sliding-window KV group's (dead entries point at its null block); None: one group

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


@dataclass
class FeedbackPlan:
    """Row `rows[k]` of this step reads the previous step's id `src[k]` at query offset
    `offsets[k]`, i.e. flat token `dest[k]`. At most one fed-back id per row."""

    rows: list[int] = field(default_factory=list)
    src: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    dest: list[int] = field(default_factory=list)

    def add(self, row: int, src: int, offset: int, dest: int) -> None:
        self.rows.append(row)
        self.src.append(src)
        self.offsets.append(offset)
        self.dest.append(dest)


@dataclass
class DeviceInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    local_slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, sliding-window group
    local_block_tables: torch.Tensor | None = None  # [num_reqs, max_blocks] int32


def new_feedback_stats() -> dict[str, int]:
    """Counters of how fed-back ids reached `input_ids` (tests read them)."""
    return {"slice": 0, "scatter": 0, "fused": 0, "rows": 0}


class TorchInputPrep:
    """Host-computed positions and slots; fed-back ids copied in with torch indexing."""

    def __init__(self, shim: DeviceShim) -> None:
        self.shim = shim
        self.stats = new_feedback_stats()

    def build(
        self, host: HostInputs, plan: FeedbackPlan, prev: torch.Tensor | None
    ) -> DeviceInputs:
        to = self.shim.to_device
        req_of = _req_of(host)
        local = host.local_block_tables
        return DeviceInputs(
            self._input_ids(host.host_tokens, plan, prev),
            to(host.positions),
            to(_slots(host.block_tables, req_of, host.positions, host.block_size)),
            to(host.query_start_loc.astype(np.int32)),
            to(host.seq_lens.astype(np.int32)),
            to(host.block_tables),
            None if local is None else to(_slots(local, req_of, host.positions, host.block_size)),
            None if local is None else to(local),
        )

    def _input_ids(
        self, host_tokens: np.ndarray, plan: FeedbackPlan, prev: torch.Tensor | None
    ) -> torch.Tensor:
        input_ids = self.shim.to_device(host_tokens)
        n = len(plan.dest)
        if n == 0:
            return input_ids
        if plan.src == list(range(n)) and plan.dest == list(range(n)):
            input_ids[:n] = prev[:n]  # unchanged batch: one slice copy
            self.stats["slice"] += 1
        else:
            device = input_ids.device
            dest = torch.tensor(plan.dest, device=device)
            input_ids[dest] = prev[torch.tensor(plan.src, device=device)]
            self.stats["scatter"] += 1
        self.stats["rows"] += n
        return input_ids


class FusedInputPrep:
    """Two packed host-to-device copies, then `csrc_triton.prepare_inputs` (one launch)."""

    def __init__(self, shim: DeviceShim) -> None:
        from vserve.csrc_triton.prepare_inputs import prepare_inputs  # imports triton: CUDA only

        self.shim = shim
        self.stats = new_feedback_stats()
        self._kernel = prepare_inputs
        # a valid pointer for steps without feedback (no row indexes it)
        self._no_prev = torch.zeros(1, dtype=torch.int64, device=shim.device)

    def build(
        self, host: HostInputs, plan: FeedbackPlan, prev: torch.Tensor | None
    ) -> DeviceInputs:
        num_reqs = host.num_reqs
        prev_index = np.full(num_reqs, -1, dtype=np.int32)
        offsets = np.zeros(num_reqs, dtype=np.int32)
        prev_index[plan.rows] = plan.src
        offsets[plan.rows] = plan.offsets
        # a sliding-window KV group (Gemma 3, Mistral): its tables and slots travel in the same
        # two copies; its slots come from the host's positions (the kernel computes the first
        # group's)
        local = host.local_block_tables
        local_tables = [] if local is None else [local.reshape(-1)]
        local_slots = (
            [] if local is None else [_slots(local, _req_of(host), host.positions, host.block_size)]
        )
        qsl, seq_lens, prev_index_d, offsets_d, table, *local_table = self._packed(
            [
                host.query_start_loc.astype(np.int32),
                host.seq_lens.astype(np.int32),
                prev_index,
                offsets,
                host.block_tables.reshape(-1),
                *local_tables,
            ],
            np.int32,
        )
        block_tables = table.view(host.block_tables.shape)
        host_tokens, num_computed, *local_slot = self._packed(
            [host.host_tokens, host.num_computed, *local_slots], np.int64
        )
        input_ids, positions, slots = self._kernel(
            qsl,
            num_computed,
            block_tables,
            host.block_size,
            host_tokens,
            self._no_prev if prev is None else prev,
            prev_index_d,
            offsets_d,
        )
        if plan.rows:
            self.stats["fused"] += 1
            self.stats["rows"] += len(plan.rows)
        return DeviceInputs(
            input_ids,
            positions,
            slots,
            qsl,
            seq_lens,
            block_tables,
            local_slot[0] if local_slot else None,
            local_table[0].view(local.shape) if local_table else None,
        )

    def _packed(self, parts: list[np.ndarray], dtype) -> list[torch.Tensor]:
        """`parts` on the device through one copy, each starting on a 16-byte boundary: the
        kernels are compiled for aligned pointers, and a part at an offset that moves with
        the batch would compile another variant (csrc_triton/variants.py)."""
        per = _ALIGN // np.dtype(dtype).itemsize
        starts, end = [], 0
        for part in parts:
            starts.append(end)
            end += -(-len(part) // per) * per
        buf = np.zeros(end, dtype=dtype)
        for start, part in zip(starts, parts):
            buf[start : start + len(part)] = part
        dev = self.shim.to_device(buf)
        return [dev[start : start + len(part)] for start, part in zip(starts, parts)]


_ALIGN = 16  # bytes


def _req_of(host: HostInputs) -> np.ndarray:
    """The request row of each token."""
    return np.repeat(np.arange(host.num_reqs), np.diff(host.query_start_loc))


def _slots(
    block_tables: np.ndarray, req_of: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Flat KV slot of each token: its request's block for the position, and the offset."""
    return (
        block_tables[req_of, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )


def make_input_prep(shim: DeviceShim) -> TorchInputPrep | FusedInputPrep:
    """The fused Triton path on CUDA; the numpy/torch path everywhere else."""
    return FusedInputPrep(shim) if shim.is_cuda else TorchInputPrep(shim)
