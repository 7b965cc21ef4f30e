"""The torch paged-attention backend equals dense attention on random paged batches."""

import pytest
import torch

from tests.support.attention_reference import make_case, reference_output
from vserve.attention import get_attention_backend
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
