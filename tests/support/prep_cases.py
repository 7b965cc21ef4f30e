"""Random step inputs for the input-preparation strategies (`vserve.workers.input_prep`),
shared by the CPU tests (fused kernel under the Triton interpreter) and the GPU tests (native)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vserve.workers.device import DeviceShim
from vserve.workers.input_prep import FeedbackPlan, FusedInputPrep, HostInputs, TorchInputPrep

FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_tables",
    "local_slot_mapping",
    "local_block_tables",
)


def random_case(
    seed: int, decode_only: bool, num_reqs: int = 6, block_size: int = 4, local: bool = False
):
    """(HostInputs, FeedbackPlan, prev ids as numpy). Decode-only cases feed rows 0..n-1 from
    prev 0..n-1 (the unchanged-batch slice); mixed cases feed a shuffled subset of rows.
    `local`: a second (sliding-window) KV group with tables of its own."""
    rng = np.random.default_rng(seed)
    q_lens = np.ones(num_reqs, dtype=np.int64) if decode_only else rng.integers(1, 9, num_reqs)
    computed = rng.integers(0, 20, num_reqs)
    seq_lens = computed + q_lens
    max_blocks = int(-(-seq_lens.max() // block_size))
    # distinct block ids, as the KV manager hands them out
    tables = rng.permutation(num_reqs * max_blocks + 5)[: num_reqs * max_blocks]
    block_tables = tables.reshape(num_reqs, max_blocks).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(computed, q_lens)])
    host_tokens = rng.integers(0, 1000, int(qsl[-1]))
    prev = rng.integers(1000, 2000, num_reqs)
    plan = FeedbackPlan()
    fed_rows = (
        range(num_reqs - 1)
        if decode_only
        else sorted(rng.choice(num_reqs, size=num_reqs // 2 + 1, replace=False).tolist())
    )
    sources = list(range(len(fed_rows))) if decode_only else rng.permutation(num_reqs).tolist()
    for row, src in zip(fed_rows, sources):
        offset = int(rng.integers(0, q_lens[row]))
        plan.add(row, src, offset, int(qsl[row] + offset))
    host_tokens[plan.dest] = -1  # the host does not know the fed-back ids
    host = HostInputs(qsl, computed, positions, seq_lens, block_tables, host_tokens, block_size)
    if local:
        local_ids = rng.permutation(num_reqs * max_blocks + 9)[: num_reqs * max_blocks]
        host.local_block_tables = local_ids.reshape(num_reqs, max_blocks).astype(np.int32)
    return host, plan, prev


def build_both(host: HostInputs, plan: FeedbackPlan, prev: np.ndarray, device: str):
    """The same step through both strategies on one device: (torch path, fused path)."""
    shim = DeviceShim(torch.device(device))
    prev_dev = torch.from_numpy(prev).to(device)
    outs = []
    for prep in (TorchInputPrep(shim), FusedInputPrep(shim)):
        # the CPU shim shares memory with numpy and the torch path scatters into it
        mine = dataclasses.replace(host, host_tokens=host.host_tokens.copy())
        outs.append((prep.build(mine, plan, prev_dev), prep.stats))
    return outs


def assert_same_inputs(
    torch_out, fused_out, host: HostInputs, plan: FeedbackPlan, prev: np.ndarray
) -> None:
    for name in FIELDS:
        got, want = getattr(fused_out, name), getattr(torch_out, name)
        assert (
            (got is None)
            == (want is None)
            == (name.startswith("local") and host.local_block_tables is None)
        ), name
        if got is None:
            continue
        assert got.dtype == want.dtype, name
        assert torch.equal(got.cpu(), want.cpu()), name
    ids = torch_out.input_ids.cpu()
    assert ids[plan.dest].tolist() == prev[plan.src].tolist()
    assert (ids >= 0).all()
    assert torch_out.positions.cpu().tolist() == host.positions.tolist()
