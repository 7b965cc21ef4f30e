"""The Triton kernels of csrc_triton equal their torch references, and the Triton attention
backend equals the torch backend through the same AttentionMetadata.

Without CUDA the kernels run under the Triton interpreter (exact but ~1000x slower), so those
cases stay tiny, and of a product of shapes, masks and head counts the fast tier runs a subset
that meets every pair (`_pairwise`), the slow tier the rest; the `gpu` tests rerun larger
shapes natively.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    # @triton.jit picks the interpreter when a function is decorated, triton.language's own
    # helpers included, so this must precede the first `import triton` of the process;
    # tests/conftest.py sets it early for the whole run, this covers running the file alone.
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and type(triton.language.zeros).__name__ == "JITFunction":
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set; its kernels "
        "cannot run on this CPU-only machine in this process"
    )

from tests.support.attention_reference import make_case, reference_output  # noqa: E402
from vserve.attention import get_attention_backend  # noqa: E402
from vserve.attention.base import AttentionLayerSpec  # noqa: E402
from vserve.csrc_triton.kv_write import kv_write, kv_write_reference  # noqa: E402
from vserve.csrc_triton.paged_attention import (  # noqa: E402
    MAX_SPLITS,
    choose_splits,
    paged_attention,
    paged_attention_reference,
)
from vserve.csrc_triton.prepare_inputs import prepare_inputs, prepare_inputs_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [  # (q_lens, ctx_lens) with block_size 4
    ([1, 1, 1], [5, 8, 9]),  # decode only; 8 ends a block, 9 is one past
    ([7, 1, 0, 12, 1], [7, 9, 3, 20, 1]),  # mixed, an empty row, a 1-token context
    ([8], [8]),  # one prefill exactly filling two blocks
    ([3, 18, 1], [40, 18, 33]),  # several query tiles and key tiles
]
HEADS = [(4, 4), (8, 2), (8, 1)]  # GQA ratios 1, 4 and 8
MASKS = [(None, None), (5, None), (None, 20.0), (3, 10.0)]  # (sliding_window, softcap)


def _pairwise(a: list, b: list, c: list, ids: tuple[str, str, str]) -> list:
    """The product a x b x c (each item a tuple of arguments), for the slow tier; the fast
    tier runs a covering subset: every pair (a, b), with c rotated so that each a and each b
    meets every c (len(c) <= len(a), len(b)). The interpreter's cases cost 0.1-0.3 s each."""
    assert len(c) <= min(len(a), len(b))
    cases = []
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            for k, z in enumerate(c):
                marks = () if k == (i + j) % len(c) else (pytest.mark.slow,)
                name = f"{ids[0]}{i}-{ids[1]}{j}-{ids[2]}{k}"
                cases.append(pytest.param(*x, *y, *z, marks=marks, id=name))
    return cases


def _case(q_lens, ctx_lens, heads, head_dim=16, block_size=4, dtype=torch.float32, seed=0):
    case = make_case(q_lens, ctx_lens, heads[0], heads[1], head_dim, block_size, dtype, seed)
    return case.to(DEVICE)


def _attend(fn, case, spec):
    m = case.meta
    return fn(
        case.query,
        case.kv_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        spec,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
    )


def _spec(heads, head_dim=16, window=None, softcap=None):
    return AttentionLayerSpec(heads[0], heads[1], head_dim, head_dim**-0.5, window, softcap)


# -- kv write --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_matches_reference_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(6, 3, 2, 16, generator=gen).to(dtype).to(DEVICE)
    key, value = fused[:, 1], fused[:, 2]  # strided views, as split from a fused qkv
    slots = torch.tensor([5, 0, -1, 11, 12, -1], device=DEVICE)  # 11|12 straddle a block
    cache = torch.randn(2, 5, 4, 2, 16, generator=gen).to(dtype).to(DEVICE)
    expected = cache.clone()
    kv_write(key, value, cache, slots)
    kv_write_reference(key, value, expected, slots)
    assert torch.equal(cache, expected)
    flat_k = cache[0].reshape(-1, 2, 16)
    assert torch.equal(flat_k[slots[slots >= 0]], key[slots >= 0])


# -- paged attention -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "q_lens, ctx_lens, window, softcap, heads",
    _pairwise(SHAPES, MASKS, [(h,) for h in HEADS], ("shape", "mask", "heads")),
)
def test_paged_attention_fp32(q_lens, ctx_lens, window, softcap, heads):
    case = _case(q_lens, ctx_lens, heads)
    kv_write_reference(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    spec = _spec(heads, window=window, softcap=softcap)
    out = _attend(paged_attention, case, spec)
    tol = TOL[torch.float32]
    torch.testing.assert_close(
        out, _attend(paged_attention_reference, case, spec), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
def test_paged_attention_half_types(dtype, heads):
    case = _case([7, 1, 0, 12, 1], [7, 9, 3, 20, 1], heads, dtype=dtype, seed=2)
    kv_write_reference(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    spec = _spec(heads, window=6, softcap=20.0)
    out = _attend(paged_attention, case, spec)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out, _attend(paged_attention_reference, case, spec), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize("head_dim, block_size", [(24, 8), (32, 8)])
def test_paged_attention_other_head_dims_and_block_size(head_dim, block_size):
    case = _case([5, 1, 1], [13, 16, 17], (4, 2), head_dim, block_size, seed=3)
    kv_write_reference(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    spec = _spec((4, 2), head_dim, window=9)
    torch.testing.assert_close(
        _attend(paged_attention, case, spec),
        _attend(paged_attention_reference, case, spec),
        atol=TOL[torch.float32],
        rtol=TOL[torch.float32],
    )


# -- split-KV ---------------------------------------------------------------------------------
# contexts at key-tile (32) and block (4) edges, long enough for several segments
SPLIT_SHAPES = [
    ([1, 1, 1, 1], [31, 32, 33, 97]),  # decode
    ([1, 5, 0, 1], [64, 70, 3, 2]),  # mixed, an empty row, contexts shorter than a tile
]


@pytest.mark.parametrize(
    "q_lens, ctx_lens, window, softcap, heads",
    _pairwise(
        SPLIT_SHAPES,
        [(None, None), (40, 30.0)],
        [((4, 1),), ((8, 2),)],  # one KV head, as Gemma 3's small models
        ("shape", "mask", "heads"),
    ),
)
@pytest.mark.parametrize("num_splits", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_split_kv_equals_reference(q_lens, ctx_lens, window, softcap, heads, num_splits):
    case = _case(q_lens, ctx_lens, heads, seed=7)
    kv_write_reference(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    spec = _spec(heads, window=window, softcap=softcap)
    out = _attend(functools.partial(paged_attention, num_splits=num_splits), case, spec)
    tol = TOL[torch.float32]
    torch.testing.assert_close(
        out, _attend(paged_attention_reference, case, spec), atol=tol, rtol=tol
    )
    # the segments' merge changes only fp32 rounding against the unsplit kernel
    torch.testing.assert_close(out, _attend(paged_attention, case, spec), atol=tol, rtol=tol)


def test_split_kv_with_more_segments_than_key_tiles():
    # MAX_SPLITS segments over contexts of 1-4 key tiles: most segments see no key
    case = _case(*SPLIT_SHAPES[0], (4, 1), seed=9)
    kv_write_reference(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    spec = _spec((4, 1), window=40, softcap=30.0)
    out = _attend(functools.partial(paged_attention, num_splits=MAX_SPLITS), case, spec)
    tol = TOL[torch.float32]
    torch.testing.assert_close(
        out, _attend(paged_attention_reference, case, spec), atol=tol, rtol=tol
    )


def test_split_kv_half_type_keeps_its_dtype():
    case = _case([1, 1], [70, 33], (4, 1), dtype=torch.bfloat16, seed=8)
    kv_write_reference(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    spec = _spec((4, 1), softcap=20.0)
    out = _attend(functools.partial(paged_attention, num_splits=3), case, spec)
    assert out.dtype == torch.bfloat16
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(
        out, _attend(paged_attention_reference, case, spec), atol=tol, rtol=tol
    )


def test_split_count_fills_the_device_and_no_more():
    assert choose_splits(128, 8192, None) == 1  # no multiprocessors: the interpreter
    assert choose_splits(64, 8192, 132) == 5  # 64 programs, 132 SMs: two waves
    assert choose_splits(8, 8192, 132) == MAX_SPLITS  # 8 programs: capped
    assert choose_splits(8, 1024, 132) == 2  # 512 keys a segment at least
    assert choose_splits(8, 300, 132) == 1  # too short to split
    assert choose_splits(512, 8192, 132) == 1  # a long prefill fills the device alone


@pytest.mark.parametrize("window, softcap", MASKS)
def test_reference_equals_dense_attention(window, softcap):
    # Guards the oracle itself against the unpaged attention of
    # tests/support/attention_reference.py.
    case = _case([7, 1, 12, 1], [7, 9, 20, 1], (8, 2), seed=4)
    kv_write_reference(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    spec = _spec((8, 2), window=window, softcap=softcap)
    torch.testing.assert_close(
        _attend(paged_attention_reference, case, spec).cpu(),
        reference_output(case, spec),
        atol=1e-5,
        rtol=1e-5,
    )


# -- backend ---------------------------------------------------------------------------------
def _run_backend(name, case, spec, block_size=4):
    backend = get_attention_backend(name, block_size=block_size)
    assert backend.name == name
    case.meta.backend_data = backend.prepare(case.meta, {spec.sliding_window})
    return backend.forward(spec, case.query, case.key, case.value, case.kv_cache, case.meta)


@pytest.mark.parametrize(
    "heads, window, softcap, q_lens, ctx_lens",
    _pairwise(
        [(h,) for h in HEADS], [(None, None), (5, 20.0)], SHAPES[:2], ("heads", "mask", "shape")
    ),
)
def test_triton_backend_equals_torch_backend(heads, window, softcap, q_lens, ctx_lens):
    spec = _spec(heads, window=window, softcap=softcap)
    ours, theirs = _case(q_lens, ctx_lens, heads), _case(q_lens, ctx_lens, heads)
    out = _run_backend("triton", ours, spec)
    expected = _run_backend("torch", theirs, spec)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(ours.kv_cache, theirs.kv_cache)


# -- prepare inputs --------------------------------------------------------------------------
def _no_feedback(num_reqs):
    none = torch.full((num_reqs,), -1, dtype=torch.int32, device=DEVICE)
    return torch.zeros(0, dtype=torch.int64, device=DEVICE), none, torch.zeros_like(none)


def test_prepare_inputs_without_feedback_rebuilds_metadata():
    q_lens, ctx_lens = [7, 1, 0, 12, 1], [7, 9, 3, 20, 1]
    case = _case(q_lens, ctx_lens, (2, 2))
    meta = case.meta
    computed = (meta.seq_lens - meta.query_start_loc.diff()).long()
    host = torch.arange(100, 100 + meta.num_tokens, device=DEVICE)
    args = (meta.query_start_loc, computed, meta.block_tables, 4, host, *_no_feedback(5))
    ids, positions, slots = prepare_inputs(*args)
    assert torch.equal(ids, host)
    assert torch.equal(positions, meta.positions)
    assert torch.equal(slots, meta.slot_mapping)
    for got, want in zip((ids, positions, slots), prepare_inputs_reference(*args)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("prev_index", [[0, 1, -1, 2], [2, 0, -1, 1]])  # identity, reordered
def test_prepare_inputs_feedback_and_padding(prev_index):
    qsl = torch.tensor([0, 1, 4, 6, 7], dtype=torch.int32, device=DEVICE)
    computed = torch.tensor([9, 0, 3, 15], device=DEVICE)
    table = torch.tensor(
        [[3, 7, 1, 0, 0], [4, 0, 0, 0, 0], [9, 2, 0, 0, 0], [5, 6, 8, 10, 11]],
        dtype=torch.int32,
        device=DEVICE,
    )
    host = torch.tensor([-1, 11, 12, -1, 20, 21, -1, 99, 99], device=DEVICE)  # 2 pad tokens
    prev = torch.tensor([501, 502, 503], device=DEVICE)
    index = torch.tensor(prev_index, dtype=torch.int32, device=DEVICE)
    offset = torch.tensor([0, 2, 0, 0], dtype=torch.int32, device=DEVICE)
    args = (qsl, computed, table, 4, host, prev, index, offset)
    ids, positions, slots = prepare_inputs(*args)
    for got, want in zip((ids, positions, slots), prepare_inputs_reference(*args)):
        assert torch.equal(got, want)
    fed = [prev.tolist()[i] for i in prev_index]
    assert ids.tolist() == [fed[0], 11, 12, fed[1], 20, 21, fed[3], 0, 0]
    assert positions.tolist() == [9, 0, 1, 2, 3, 4, 15, 0, 0]
    assert slots.tolist() == [5, 16, 17, 18, 39, 8, 43, -1, -1]


# -- GPU: larger shapes, native ------------------------------------------------------------
def _big_case(dtype, heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens = [1] * 40 + [37, 300, 5, 129]
    ctx_lens = [int(torch.randint(1, 3000, (1,), generator=gen)) for _ in range(40)]
    ctx_lens += [37, 700, 2049, 129]
    return _case(q_lens, ctx_lens, heads, head_dim, 16, dtype, seed), q_lens, ctx_lens


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "dtype, heads, head_dim",
    [(torch.bfloat16, (32, 8), 128), (torch.float16, (16, 16), 64), (torch.float32, (8, 1), 96)],
)
@pytest.mark.parametrize("window, softcap", [(None, None), (512, 50.0)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])  # None: as the backend chooses
def test_gpu_paged_attention_large(dtype, heads, head_dim, window, softcap, num_splits):
    case, _, _ = _big_case(dtype, heads, head_dim, seed=5)
    kv_write(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    expected_cache = case.kv_cache.clone()
    kv_write_reference(case.key, case.value, expected_cache, case.meta.slot_mapping)
    assert torch.equal(case.kv_cache, expected_cache)
    spec = _spec(heads, head_dim, window, softcap)
    torch.testing.assert_close(
        _attend(functools.partial(paged_attention, num_splits=num_splits), case, spec),
        _attend(paged_attention_reference, case, spec),
        atol=TOL[dtype],
        rtol=TOL[dtype],
    )


@pytest.mark.gpu
@gpu
def test_gpu_backend_and_prepare_inputs_large():
    case, q_lens, _ = _big_case(torch.bfloat16, (16, 4), 128, seed=6)
    twin, _, _ = _big_case(torch.bfloat16, (16, 4), 128, seed=6)
    spec = _spec((16, 4), 128, 1024, None)
    out = _run_backend("triton", case, spec, block_size=16)
    expected = _run_backend("torch", twin, spec, block_size=16)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    meta, num_reqs = case.meta, len(q_lens)
    computed = (meta.seq_lens - meta.query_start_loc.diff()).long()
    host = torch.randint(0, 32000, (meta.num_tokens + 8,), device=DEVICE)
    prev = torch.randint(0, 32000, (num_reqs,), device=DEVICE)
    index = torch.randperm(num_reqs, device=DEVICE).int()
    index[::3] = -1
    args = (
        meta.query_start_loc,
        computed,
        meta.block_tables,
        16,
        host,
        prev,
        index,
        torch.zeros_like(index),
    )
    ids, positions, slots = prepare_inputs(*args)
    assert torch.equal(positions[: meta.num_tokens], meta.positions)
    assert torch.equal(slots[: meta.num_tokens], meta.slot_mapping)
    for got, want in zip((ids, positions, slots), prepare_inputs_reference(*args)):
        assert torch.equal(got, want)
