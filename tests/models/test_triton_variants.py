"""A serving run compiles few variants of each Triton kernel: the batch size, the block
table's width and the offsets of the packed input buffers change every step, and each change
of an argument's specialization class (an integer's: 1, a multiple of 16, other; a pointer's
16-byte alignment) would compile a new variant mid-run (the first GPU check saw steps of
17-42 ms where the same steps took 1.4 ms once compiled). Counted by Triton's rules
(`csrc_triton/variants.py`) on the interpreter, so this runs without a GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (see test_triton_kernels.py)
pytest.importorskip("triton")

from tests.support.prep_cases import random_case  # noqa: E402
from vserve.attention.base import AttentionLayerSpec  # noqa: E402
from vserve.csrc_triton import paged_attention as pa  # noqa: E402
from vserve.csrc_triton import prepare_inputs as pi  # noqa: E402
from vserve.csrc_triton.variants import VariantCounter  # noqa: E402
from vserve.workers.device import DeviceShim  # noqa: E402
from vserve.workers.input_prep import FusedInputPrep  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# batch sizes a run passes through as requests arrive and finish: 1, every residue mod 4 (the
# packed buffers' offsets, hence their alignment), a multiple of 16 and the sizes around it
BATCHES = [1, 2, 3, 5, 6, 7, 9, 12, 15, 16, 17, 18, 19]


@pytest.mark.slow  # the Triton interpreter over a whole serving run
def test_a_serving_run_compiles_few_variants():
    counter = VariantCounter(
        {
            "prepare_inputs": pi._prepare_inputs_kernel,
            "paged_attention": pa._paged_attention_kernel,
            "merge_splits": pa._merge_splits_kernel,
        }
    )
    prep = FusedInputPrep(DeviceShim(torch.device(DEVICE)))
    spec = AttentionLayerSpec(2, 1, 16, 0.25, None, None)
    gen = torch.Generator().manual_seed(0)
    for step, num_reqs in enumerate(BATCHES):
        for decode_only in (True, False):
            host, plan, prev = random_case(step, decode_only, num_reqs=num_reqs, block_size=4)
            dev = prep.build(host, plan, torch.from_numpy(prev).to(DEVICE))
            num_blocks = int(host.block_tables.max()) + 1
            kv = torch.randn(2, num_blocks, 4, 1, 16, generator=gen).to(DEVICE)
            query = torch.randn(len(host.positions), 2, 16, generator=gen).to(DEVICE)
            max_q = int(max(host.query_start_loc[1:] - host.query_start_loc[:-1]))
            args = (query, kv, dev.query_start_loc, dev.seq_lens, dev.block_tables, spec, max_q)
            pa.paged_attention(*args)
            if step % 2:  # split-KV, a changing count
                pa.paged_attention(*args, num_splits=2 + step % 8 // 2)
    counts = counter.counts()
    assert counts["prepare_inputs"] == 1, counts
    # decode-only and mixed tiles, times split or not
    assert counts["paged_attention"] <= 4, counts
    assert counts["merge_splits"] == 1, counts
