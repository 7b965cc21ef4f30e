"""DecodeStack (vserve/cpu_ops/stack.cpp): all the layers of a decode step in one call on GGUF
blocks, bitwise the per-layer `decoder_layer_q` calls it replaces, on the int8 and the exact
gemv path, for 1 and several rows, both norm styles and a sliding-window layer. The caches it
writes are bitwise theirs too."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.cpu_ops.test_quant_kernels import random_weight
from vserve import cpu_ops
from vserve.models.gguf_source import Q5_0R

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the kernels cannot be built",
)
BF = torch.bfloat16
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 256, 2, 1, 128, 512, 4


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "the CPU kernels failed to build (see the log)"
    return module


def _blocks(qtype, n, k, seed):
    return torch.from_numpy(random_weight(qtype, n, k, seed))


def _layer(seed: int, style: int, window: int, inter: int = INTER):
    """inter: the MLP's width; one that is no multiple of 256 gets a Q8_0 down projection"""
    qd, kd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    down = (
        [_blocks(Q.Q4_0, HIDDEN // 2, inter, seed + 4), _blocks(Q.Q5_K, HIDDEN // 2, inter, 9)]
        if inter % 256 == 0
        else [_blocks(Q.Q8_0, HIDDEN, inter, seed + 4)]
    )
    parts = [
        [_blocks(Q.Q5_0, qd + kd, HIDDEN, seed), _blocks(Q.Q8_0, kd, HIDDEN, seed + 1)],
        [_blocks(Q.Q4_K, HIDDEN, qd, seed + 2)],
        [_blocks(Q.Q6_K, 2 * inter, HIDDEN, seed + 3)],
        down,
    ]
    down_formats = [Q.Q4_0, Q.Q5_K] if inter % 256 == 0 else [Q.Q8_0]
    formats = ([Q.Q5_0, Q.Q8_0], [Q.Q4_K], [Q.Q6_K], down_formats)
    qtypes = [[int(t) for t in ts] for ts in formats]
    g = torch.Generator().manual_seed(seed)
    if style == 1:  # Gemma: fp32 scales, with q / k norms
        norms = [1 + 0.1 * torch.randn(HIDDEN, generator=g) for _ in range(4)]
        norms += [1 + 0.1 * torch.randn(HEAD_DIM, generator=g) for _ in range(2)]
    else:  # Llama: bf16 weights, no q / k norms
        norms = [(1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(BF) for _ in range(2)]
    biases: list[torch.Tensor | None] = [None, None, None, None]
    if style == 0:
        biases[0] = (0.1 * torch.randn(qd + 2 * kd, generator=g)).to(BF)
    consts = (HEADS, KV_HEADS, HEAD_DIM, window, HEAD_DIM**-0.5, 0.0, 1e-6, style, style)
    return parts, qtypes, biases, norms, consts


def _inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, HIDDEN, generator=g).to(BF)
    lens = torch.tensor([5 + 3 * r for r in range(rows)])
    tables = torch.arange(rows * 8).view(rows, 8)  # 8 blocks of 4 per row
    slots = torch.stack(
        [tables[r, (lens[r] - 1) // BLOCK] * BLOCK + (lens[r] - 1) % BLOCK for r in range(rows)]
    )
    angles = torch.randn(rows, 1, HEAD_DIM, generator=g)
    return h, lens, tables, slots, angles.cos().to(BF), angles.sin().to(BF)


def _check_bitwise(ops, layers, rows):
    h, lens, tables, slots, cos, sin = _inputs(rows)
    g = torch.Generator().manual_seed(1)
    caches = [
        torch.randn(2, rows * 8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(BF) for _ in layers
    ]
    stack = ops.DecodeStack()
    for parts, qtypes, biases, norms, consts in layers:
        stack.add_layer(parts, qtypes, biases, norms, *consts, 0)
    mine = [c.clone() for c in caches]
    out = stack.run(h, [cos], [sin], mine, slots, tables, slots, tables, lens)
    ref = h
    for (parts, qtypes, biases, norms, consts), cache in zip(layers, caches):
        ref = ops.decoder_layer_q(
            ref, parts, qtypes, biases, norms, cache, slots, tables, lens, cos, sin, *consts, None
        )
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    for a, b in zip(mine, caches):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(h, _inputs(rows)[0])  # its input stays as it was


@pytest.mark.parametrize("rows", [1, 8])
def test_stack_on_repacked_q5_0_is_bitwise_the_q5_0_stack(ops, rows):
    """The decode stack on Q5_0R parts (Q5_0 repacked at load) gives bitwise what it gives on
    the GGUF bytes: output and KV cache."""
    if not ops.quant.q5_0r_supported():
        pytest.skip("this CPU's gemv does not take four blocks a step (AVX512 VBMI / BITALG)")
    layers = [_layer(s, 1, -1) for s in range(2)]
    repacked = []
    for parts, qtypes, biases, norms, consts in layers:
        parts = [list(p) for p in parts]
        qtypes = [list(q) for q in qtypes]
        assert qtypes[0][0] == int(Q.Q5_0)
        parts[0][0], qtypes[0][0] = ops.quant.repack_q5_0(parts[0][0], HIDDEN), Q5_0R
        repacked.append((parts, qtypes, biases, norms, consts))
    h, lens, tables, slots, cos, sin = _inputs(rows)
    outs = []
    for ls in (layers, repacked):
        stack = ops.DecodeStack()
        for parts, qtypes, biases, norms, consts in ls:
            stack.add_layer(parts, qtypes, biases, norms, *consts, 0)
        g = torch.Generator().manual_seed(1)
        caches = [
            torch.randn(2, rows * 8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(BF) for _ in ls
        ]
        outs.append(
            (stack.run(h, [cos], [sin], caches, slots, tables, slots, tables, lens), caches)
        )
    (a, ca), (b, cb) = outs
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(ca, cb))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("style", [1, 0])
def test_stack_is_bitwise_the_per_layer_calls(ops, exact, rows, style):
    """On the int8 gemv and on the exact one (the exact switch, which the stack's gemvs
    read on each call as the per-layer ones do)."""
    loaded = ops.quant.options()
    ops.quant.set_options(exact=exact)
    try:
        layers = [_layer(10 * i, style, window=8 if i == 1 else -1) for i in range(3)]
        _check_bitwise(ops, layers, rows)
    finally:
        ops.quant.set_options(**loaded)


@pytest.mark.parametrize("style", [1, 0])  # gelu, silu
def test_stack_splits_the_activation_bitwise_at_a_ragged_width(ops, style):
    """The team splits the gated activation into column ranges at multiples of 64; a width
    that is not one (480: the last range ends in 32 columns that ATen's vectorized loop takes
    alone) gets the one-call values on 2 and 3 threads too."""
    threads = torch.get_num_threads()
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            _check_bitwise(ops, [_layer(7, style, window=-1, inter=480)], rows=3)
    finally:
        torch.set_num_threads(threads)


def test_stack_runs_on_one_thread_and_inside_a_parallel_region(ops):
    """The master alone takes every chunk when no helper comes (one thread)."""
    parts, qtypes, biases, norms, consts = _layer(0, 1, -1)
    h, lens, tables, slots, cos, sin = _inputs(2)
    cache = torch.zeros(2, 16, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF)
    stack = ops.DecodeStack()
    stack.add_layer(parts, qtypes, biases, norms, *consts, 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = stack.run(h, [cos], [sin], [cache.clone()], slots, tables, slots, tables, lens)
    finally:
        torch.set_num_threads(threads)
    two = stack.run(h, [cos], [sin], [cache.clone()], slots, tables, slots, tables, lens)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))


def test_stack_rejects_bad_inputs(ops):
    parts, qtypes, biases, norms, consts = _layer(0, 1, -1)
    stack = ops.DecodeStack()
    with pytest.raises(RuntimeError, match="GGUF blocks"):
        stack.add_layer(
            [[torch.zeros(4, 4, dtype=BF)]] + parts[1:],
            [[8]] + qtypes[1:],
            biases,
            norms,
            *consts,
            0,
        )
    narrow = [n[: HIDDEN // 2].contiguous() for n in norms[:4]] + norms[4:]
    with pytest.raises(RuntimeError, match="linear sizes"):  # (a hidden size of 128)
        stack.add_layer(parts, qtypes, biases, narrow, *consts, 0)
    stack.add_layer(parts, qtypes, biases, norms, *consts, 0)  # the rejected sizes left no trace
    h, lens, tables, slots, cos, sin = _inputs(9)
    cache = torch.zeros(2, 72, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        stack.run(h, [cos], [sin], [cache], slots, tables, slots, tables, lens)
    h, lens, tables, slots, cos, sin = _inputs(1)
    with pytest.raises(RuntimeError, match="slot out of range"):
        stack.run(h, [cos], [sin], [cache], slots + 10**6, tables, slots + 10**6, tables, lens)


@pytest.mark.timeout(120, method="thread")  # a lost chunk would hang the step, not fail it
def test_a_failing_chunk_raises_and_the_stack_runs_again(ops):
    """A chunk's exception (a helper's or the master's) reaches the caller after every chunk is
    done, instead of hanging the step or unwinding frames the helpers still use; the next step
    runs as before."""
    layers = [_layer(10 * i, 1, window=-1) for i in range(2)]
    h, lens, tables, slots, cos, sin = _inputs(3)
    cache = torch.zeros(2, 24, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF)
    stack = ops.DecodeStack()
    for parts, qtypes, biases, norms, consts in layers:
        stack.add_layer(parts, qtypes, biases, norms, *consts, 0)

    def step():
        caches = [cache.clone(), cache.clone()]
        return stack.run(h, [cos], [sin], caches, slots, tables, slots, tables, lens)

    good = step()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # helpers, even on 2 cores
        ops.DecodeStack._fail_chunks(True)
        with pytest.raises(RuntimeError, match="a chunk failed"):
            step()
    finally:
        ops.DecodeStack._fail_chunks(False)
        torch.set_num_threads(threads)
    again = step()
    assert torch.equal(again.view(torch.int16), good.view(torch.int16))


@pytest.mark.timeout(120, method="thread")
def test_stack_runs_from_threads_one_step_at_a_time(ops):
    """`run` releases the GIL; steps from two threads on one stack take turns (its buffers are
    the stack's) and give the bits of a step alone."""
    parts, qtypes, biases, norms, consts = _layer(0, 0, -1)
    h, lens, tables, slots, cos, sin = _inputs(2)
    cache = torch.zeros(2, 16, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF)
    stack = ops.DecodeStack()
    stack.add_layer(parts, qtypes, biases, norms, *consts, 0)

    def step():
        return stack.run(h, [cos], [sin], [cache.clone()], slots, tables, slots, tables, lens)

    alone = step()
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: step(), range(4)))
    assert all(torch.equal(o.view(torch.int16), alone.view(torch.int16)) for o in outs)
