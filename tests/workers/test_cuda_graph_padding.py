"""The CUDA-graph bookkeeping that needs no GPU: which captured size a decode batch maps to,
when graphs are used at all, and how padding rows are filled. The last test runs a padded
decode batch through the Triton backend (interpreter on CPU): the real rows' outputs equal the
unpadded batch's and the padding rows leave the KV cache untouched."""

import pytest
import torch

from tests.support.attention_reference import make_case
from vserve.attention.base import AttentionLayerSpec
from vserve.workers.cuda_graphs import (
    DecodeBuffers,
    capture_sizes,
    is_decode_batch,
    padded_size,
    use_cuda_graphs,
)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 9, 17, 64, 256])
def test_capture_sizes_cover_every_batch_with_little_padding(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_num_seqs
    for num_reqs in range(1, max_num_seqs + 1):
        size = padded_size(num_reqs, sizes)
        assert size in sizes and size >= num_reqs
        assert all(s < num_reqs for s in sizes if s < size)  # the smallest that fits
        assert size - num_reqs < max(8, num_reqs)  # padding < 8 rows or < 2x
    assert padded_size(max_num_seqs + 1, sizes) is None


def test_capture_sizes_ladder():
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert padded_size(3, capture_sizes(40)) == 4
    assert padded_size(17, capture_sizes(40)) == 24


def test_graphs_only_for_cuda_triton_not_eager_single_stage():
    assert use_cuda_graphs("cuda", "triton", enforce_eager=False, pp_size=1)
    assert not use_cuda_graphs("cpu", "triton", enforce_eager=False, pp_size=1)
    assert not use_cuda_graphs("cuda", "torch", enforce_eager=False, pp_size=1)
    assert not use_cuda_graphs("cuda", "triton", enforce_eager=True, pp_size=1)
    assert not use_cuda_graphs("cuda", "triton", enforce_eager=False, pp_size=2)


def test_only_one_token_rows_are_decode_batches():
    assert is_decode_batch(make_case([1, 1, 1], [5, 8, 9], 2, 2, 8, 4).meta)
    assert not is_decode_batch(make_case([1, 3], [5, 8], 2, 2, 8, 4).meta)
    assert not is_decode_batch(make_case([1, 0, 1], [5, 3, 9], 2, 2, 8, 4).meta)


def _decode_case(num_reqs, seed, device="cpu"):
    ctx = [5 + 3 * i for i in range(num_reqs)]
    return make_case([1] * num_reqs, ctx, 4, 2, 16, 4, seed=seed).to(device)


def test_load_fills_real_rows_and_resets_the_rows_a_larger_batch_left():
    bufs = DecodeBuffers(max_size=8, max_blocks=6, device=torch.device("cpu"))
    big, small = _decode_case(6, seed=1), _decode_case(3, seed=2)
    bufs.load(torch.arange(100, 106), big.meta)
    bufs.load(torch.arange(200, 203), small.meta)
    m = small.meta
    nb = m.block_tables.shape[1]
    assert bufs.input_ids.tolist() == [200, 201, 202] + [0] * 5
    assert bufs.positions.tolist() == m.positions.tolist() + [0] * 5
    assert bufs.slot_mapping.tolist() == m.slot_mapping.tolist() + [-1] * 5
    assert bufs.seq_lens.tolist() == m.seq_lens.tolist() + [1] * 5
    assert torch.equal(bufs.block_tables[:3, :nb], m.block_tables)
    assert not bufs.block_tables[3:].any()
    assert bufs.query_start_loc.tolist() == list(range(9))  # one token per row, constant
    meta = bufs.meta(4, max_seq_len=64)
    assert meta.num_tokens == meta.num_reqs == 4 and meta.max_query_len == 1
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_padded_decode_batch_equals_unpadded_through_triton_backend():
    pytest.importorskip("triton")
    from vserve.attention import get_attention_backend

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs native or interpreted
    backend = get_attention_backend("triton", block_size=4)
    spec = AttentionLayerSpec(4, 2, 16, 16**-0.5, None, 20.0)
    plain, padded = _decode_case(3, seed=3, device=dev), _decode_case(3, seed=3, device=dev)
    out = backend.forward(spec, plain.query, plain.key, plain.value, plain.kv_cache, plain.meta)

    bufs = DecodeBuffers(max_size=8, max_blocks=8, device=torch.device(dev))
    zeros = torch.zeros(6, dtype=torch.int64, device=dev)
    bufs.load(zeros, _decode_case(6, seed=4, device=dev).meta)  # dirty rows
    bufs.load(zeros[:3], padded.meta)
    meta = bufs.meta(4, max_seq_len=64)
    gen = torch.Generator().manual_seed(5)
    pad = [torch.randn(1, h, 16, generator=gen).to(dev) for h in (4, 2, 2)]  # padding: any
    query = torch.cat([padded.query, pad[0]])
    key = torch.cat([padded.key, pad[1]])
    value = torch.cat([padded.value, pad[2]])
    got = backend.forward(spec, query, key, value, padded.kv_cache, meta)
    assert torch.equal(got[:3], out)
    assert torch.isfinite(got[3:]).all()
    assert torch.equal(padded.kv_cache, plain.kv_cache)  # slot -1: nothing written
