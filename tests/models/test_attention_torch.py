"""The torch paged-attention backend equals dense attention on random paged batches."""

import pytest
import torch

from tests.support.attention_reference import make_case, reference_output
from vserve.attention import get_attention_backend, torch_backend
from vserve.attention.base import AttentionLayerSpec

SHAPES = [  # (q_lens, ctx_lens)
    ([1, 1, 1], [5, 17, 33]),  # decode only
    ([7, 1, 12, 1], [7, 9, 40, 1]),  # mixed prefill chunks and decodes
    ([16], [16]),  # one prefill at a block boundary
    ([3, 5], [19, 64]),  # chunks with context
    ([6, 6], [6, 6]),  # one direct group holds the whole step
    ([5], [21]),  # one context chunk holds the whole step
]


@pytest.mark.parametrize("q_lens, ctx_lens", SHAPES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_paged_equals_dense(q_lens, ctx_lens, heads, window, softcap):
    num_heads, num_kv = heads
    spec = AttentionLayerSpec(num_heads, num_kv, 16, 16**-0.5, window, softcap)
    case = make_case(q_lens, ctx_lens, num_heads, num_kv, 16, block_size=4)
    backend = get_attention_backend("torch", block_size=4)
    case.meta.backend_data = backend.prepare(case.meta, {window})
    out = backend.forward(spec, case.query, case.key, case.value, case.kv_cache, case.meta)
    torch.testing.assert_close(out, reference_output(case, spec), atol=1e-5, rtol=1e-5)


def test_kv_write_lands_in_slots():
    case = make_case([3, 1], [3, 6], 2, 2, 8, block_size=4)
    backend = get_attention_backend("torch", block_size=4)
    spec = AttentionLayerSpec(2, 2, 8, 8**-0.5)
    case.meta.backend_data = backend.prepare(case.meta, {None})
    backend.forward(spec, case.query, case.key, case.value, case.kv_cache, case.meta)
    flat = case.kv_cache[0].view(-1, 2, 8)
    torch.testing.assert_close(flat[case.meta.slot_mapping], case.key)


LONG = [  # (q_lens, ctx_lens) in tiles of 8 query rows
    ([40], [40]),  # a direct prefill of five tiles
    ([21, 1, 37], [21, 30, 90]),  # a partial last tile, a decode, a chunk after context
    ([13, 13], [13, 13]),  # a direct group of two rows
]


@pytest.mark.parametrize("q_lens, ctx_lens", LONG)
@pytest.mark.parametrize("window", [None, 6, 13, 64])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_prefill_tiles_equal_dense(monkeypatch, q_lens, ctx_lens, window, softcap):
    """Prefills in query tiles (windows shorter, equal to and longer than a tile) equal dense
    attention, GQA and softcap included."""
    monkeypatch.setattr(torch_backend, "PREFILL_TILE", 8)
    spec = AttentionLayerSpec(8, 2, 16, 16**-0.5, window, softcap)
    case = make_case(q_lens, ctx_lens, 8, 2, 16, block_size=4, seed=3)
    backend = get_attention_backend("torch", block_size=4)
    case.meta.backend_data = backend.prepare(case.meta, {window})
    out = backend.forward(spec, case.query, case.key, case.value, case.kv_cache, case.meta)
    torch.testing.assert_close(out, reference_output(case, spec), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 100, 512])
@pytest.mark.parametrize("start", [0, 300, 4096])
def test_prefill_tiles_reach_only_the_keys_their_queries_see(window, start):
    """Each tile's keys run from the first one its first query sees to its last query, so a
    sliding-window layer's work grows with window x length: at most PREFILL_TILE + window - 1
    keys a tile (and a prefill without context or window is one causal call)."""
    q_len = 2048
    tiles = torch_backend._prefill_tiles(start, q_len, window, "cpu")
    if start == 0 and window is None:
        assert [(t.q0, t.q1, t.k0, t.k1, t.mask) for t in tiles] == [(0, q_len, 0, q_len, None)]
        return
    tile = torch_backend.PREFILL_TILE
    assert [t.q0 for t in tiles] == list(range(0, q_len, tile))
    assert all(t.q1 == min(q_len, t.q0 + tile) for t in tiles)
    for t in tiles:
        first_query = start + t.q0
        assert t.k1 == start + t.q1
        assert t.k0 == (0 if window is None else max(0, first_query - window + 1))
        if window is not None:
            assert t.k1 - t.k0 <= tile + window - 1
        if t.mask is not None:
            q_pos = torch.arange(start + t.q0, start + t.q1)[:, None]
            k_pos = torch.arange(t.k0, t.k1)[None, :]
            visible = (k_pos <= q_pos) & (True if window is None else k_pos > q_pos - window)
            assert torch.equal(t.mask[0, 0], visible)
