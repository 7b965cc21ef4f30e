"""VSERVE_CPU_ISA: the instruction sets the CPU kernels target, fewer than the CPU's on request.

The unit tests pin /proc/cpuinfo's flags; the build tests compile the kernels for the AVX2,
AVX-VNNI and portable targets in a fresh process (each in its own cache folder, a minute and
a half each on 2 cores, run beside the suite: `tests/support/isa_builds.py`) and check that
each build runs the path it should, against the dequantized reference.
"""

from __future__ import annotations

import platform
import textwrap

import pytest

from tests.support import isa_builds
from vserve import envs
from vserve.host import isa

X86 = platform.machine().lower() in ("x86_64", "amd64")
ZEN4 = {"sse4_2", "pni", "ssse3", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"}


@pytest.fixture
def flags(monkeypatch):
    def use(found: set[str], choice: str) -> None:
        monkeypatch.setattr(isa, "raw_cpu_flags", lambda: set(found))
        monkeypatch.setenv("VSERVE_CPU_ISA", choice)

    return use


def test_native_keeps_every_flag(flags):
    flags(SAPPHIRE_RAPIDS, "native")
    assert isa.cpu_flags() == SAPPHIRE_RAPIDS
    assert isa.compiler_flags() == ["-march=native"] and isa.torch_env() == {}


def test_avx2_drops_avx512_vnni_and_amx(flags):
    flags(SAPPHIRE_RAPIDS, "avx2")
    assert isa.cpu_flags() == {"sse4_2", "pni", "ssse3", "avx", "avx2", "fma", "f16c"}
    if X86:
        assert isa.compiler_flags() == ["-march=x86-64-v3", "-mtune=native"]
        assert isa.torch_env()["ATEN_CPU_CAPABILITY"] == "avx2"
        assert isa.torch_env()["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_avx_vnni_keeps_avx_vnni_alone_above_avx2(flags):
    flags(SAPPHIRE_RAPIDS, "avx_vnni")
    assert isa.cpu_flags() == {"sse4_2", "pni", "ssse3", "avx", "avx2", "fma", "f16c", "avx_vnni"}
    if X86:
        assert isa.compiler_flags() == ["-march=x86-64-v3", "-mavxvnni", "-mtune=native"]
        assert isa.torch_env()["ATEN_CPU_CAPABILITY"] == "avx2"


def test_avx_vnni_is_refused_on_a_cpu_without_it(flags):
    """Kernels built with it would stop at their first vpdpbusd: the load says why instead of
    falling back to the eager path as it does without a compiler."""
    from vserve import cpu_ops

    flags(ZEN4, "avx_vnni")
    assert "avx_vnni" not in isa.cpu_flags()
    with pytest.raises(ValueError, match="no AVX-VNNI"):
        isa.check()
    with pytest.raises(ValueError, match="no AVX-VNNI"):
        cpu_ops._load("avx-vnni-refused", lambda: pytest.fail("built"))


def test_portable_drops_every_vector_extension(flags):
    flags(SAPPHIRE_RAPIDS | {"sse", "sse2", "fpu"}, "portable")
    assert isa.cpu_flags() == {"sse", "sse2", "fpu"}
    if X86:
        assert isa.compiler_flags() == ["-march=x86-64", "-mtune=native"]
        assert isa.torch_env()["ATEN_CPU_CAPABILITY"] == "default"


def test_what_asks_for_flags_sees_the_choice(flags):
    """The dtype `auto` resolves to and the int8 gemv's presence follow the switch."""
    from vserve.config import cpu_has_bf16, cpu_has_int8_gemv

    flags(SAPPHIRE_RAPIDS, "native")
    assert cpu_has_bf16() and cpu_has_int8_gemv()
    flags(SAPPHIRE_RAPIDS, "avx2")
    assert not cpu_has_bf16() and cpu_has_int8_gemv()
    flags(SAPPHIRE_RAPIDS, "portable")
    assert not cpu_has_bf16() and not cpu_has_int8_gemv()


def test_each_isa_builds_in_its_own_folder(flags):
    from vserve import cpu_ops

    flags(SAPPHIRE_RAPIDS, "native")
    native = cpu_ops.build_dir()
    flags(SAPPHIRE_RAPIDS, "avx2")
    assert cpu_ops.build_dir() != native


def test_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv("VSERVE_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="VSERVE_CPU_ISA must be native, avx_vnni, avx2 or"):
        envs.read_env()


def test_pin_torch_keeps_what_the_user_set(flags):
    """Into a copy of the environment: the real one would hold every later test's workers to
    AVX2 (oneDNN then refuses their bf16 weights)."""
    if not X86:
        pytest.skip("torch's ISA switches are x86's")
    flags(ZEN4, "avx2")
    environ = {"ATEN_CPU_CAPABILITY": "default"}
    isa.pin_torch(environ)
    assert environ["ATEN_CPU_CAPABILITY"] == "default"
    assert environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"


def attention(module):
    """The paged decode attention of seeded bf16 and fp32 inputs: 16 rows of 4 query heads on
    one KV head of 256 (the embedded model's), and a sliding window of 8 heads on 2 of 64."""
    import torch

    gen = torch.Generator().manual_seed(0)
    outs = []
    for dtype in (torch.bfloat16, torch.float32):
        for rows, heads, kv_heads, dim, length, window in (
            (16, 4, 1, 256, 200, -1),
            (3, 8, 2, 64, 77, 32),
        ):
            blocks = (length + 15) // 16
            k = torch.randn(rows * blocks + 1, 16, kv_heads, dim, generator=gen).to(dtype)
            v = torch.randn(k.shape, generator=gen).to(dtype)
            q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
            tables = torch.arange(rows * blocks).view(rows, blocks)
            lengths = torch.full((rows,), length, dtype=torch.long)
            outs.append(module.decode_attention(q, k, v, tables, lengths, window, 0.0625, 0.0))
    return outs


def sampled(module):
    """The fused sampler on seeded logits of the embedded model's vocabulary: 8 bf16 rows at
    temperatures 0 (argmax), 0.7 and 1 and 2 fp32 rows, each with its own u, and the top 40
    candidates of a filtered row; the tokens and candidate probabilities."""
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for dtype, rows in ((torch.bfloat16, 8), (torch.float32, 2)):
        logits = (torch.randn(rows, 262144, generator=gen) * 5).to(dtype)
        temps = torch.tensor([0.0, 0.7, 1.0, 1.0][:rows] * 2, dtype=torch.float32)[:rows]
        u = torch.rand(rows, generator=gen, dtype=torch.float64)
        counts = torch.zeros(rows, dtype=torch.long)
        counts[1] = 40
        tokens, ids, probs = module.sample(logits, temps, u, counts)
        out += [tokens, ids[1, :40], probs[1, :40], module.argmax(logits)]
    return out


# A fresh process under VSERVE_CPU_ISA: the build, its int8 gemv, and matmul at 1 and 24 rows
# on each block format against the dequantized reference (fp32 sums of the int8 products on
# AVX2, the exact products on the portable build).
CHILD = textwrap.dedent(
    """
    import json, sys, numpy as np, torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
    from vserve import cpu_ops
    from vserve.config import cpu_has_bf16
    from tests.cpu_ops.test_isa import attention, sampled
    quant = cpu_ops.load_quant()
    out = {"int8_gemv": quant.int8_gemv(), "amx": quant.amx_gemm(), "bf16": cpu_has_bf16(),
           "capability": torch.backends.cpu.get_cpu_capability(), "errors": {}}
    int8 = []  # (weight, qtype, x, AVX2 gemv of x[:5], AVX2 GEMM of x)
    rng = np.random.default_rng(0)
    # random valid blocks: random bytes, small fp16 scales at each format's scale fields
    layout = {Q.Q4_0: (32, 18, [0]), Q.Q5_0: (32, 22, [0]), Q.Q8_0: (32, 34, [0]),
              Q.Q4_K: (256, 144, [0, 2]), Q.Q5_K: (256, 176, [0, 2]), Q.Q6_K: (256, 210, [208])}
    for qtype, (block, size, halves) in layout.items():
        raw = rng.integers(0, 256, size=(40, 512 // block, size), dtype=np.uint8)
        for off in halves:
            half = (rng.standard_normal((40, 512 // block)) * 0.01).astype(np.float16)
            raw[:, :, off : off + 2] = half.view(np.uint8).reshape(40, 512 // block, 2)
        data = raw.reshape(40, -1)
        ref = torch.from_numpy(dequantize(data, qtype)).double()
        for m in (1, 24):
            x = torch.randn(m, 512).to(torch.bfloat16)
            y = quant.matmul(x, torch.from_numpy(data), int(qtype), 512).double()
            exact = x.double() @ ref.T
            scale = (x.double().abs() @ ref.abs().T).max().item()
            out["errors"][f"{qtype.name}-{m}"] = ((y - exact).abs().max() / scale).item()
            if m > 8 and quant.int8_gemv() in ("avx2", "avx_vnni"):  # matmul's path past 8
                w = torch.from_numpy(data)
                gemm = quant.gemm_avx2(x, w, int(qtype), 512)
                out.setdefault("took_gemm", []).append(bool(torch.equal(y, gemm.double())))
                int8.append((w, int(qtype), x, quant.gemv_avx2(x[:5], w, int(qtype), 512), gemm))
    torch.save(int8, sys.argv[1] + ".int8")
    torch.save(attention(cpu_ops.load()), sys.argv[1])
    torch.save(sampled(cpu_ops.load_sampler()), sys.argv[1] + ".sample")
    print(json.dumps(out))
    """
)


AVX_VNNI = pytest.mark.skipif(
    "avx_vnni" not in isa.raw_cpu_flags(), reason="this CPU has no AVX-VNNI (avx_vnni)"
)
# a package import, as a user's process makes it, sets torch's switches before its kernels
CHILD_CODE = "import vserve\n" + CHILD


def will_run(choice: str) -> bool:
    """Whether the build test of `choice` runs on this machine (else it skips)."""
    return X86 and (choice != "avx_vnni" or "avx_vnni" in isa.raw_cpu_flags())


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="the AVX2 and portable targets are x86's")
@pytest.mark.parametrize("choice", ["avx2", pytest.param("avx_vnni", marks=AVX_VNNI), "portable"])
def test_forced_isa_builds_and_multiplies(choice):
    """The kernels built for fewer instruction sets than this CPU has: AVX2 takes the AVX2
    int8 gemv and GEMM (no VNNI, no AMX; torch held to AVX2 too), AVX-VNNI the same with its
    byte dots in vpdpbusd, portable takes none and the exact path; each within its bound of
    the dequantized product, relative to the sum of |x| |w| (the bf16 result's rounding, and
    on AVX2 the activations' int8 rounding). The AVX2 int8 products of both AVX2 builds are
    this machine's build's own, bit for bit (integer dots, then the same fp32 operations), as
    is their decode attention (the same lanes and order of sums); the portable build's
    attention, without fused multiply-adds, is within a rounding."""
    import json

    status, stdout, stderr, saved = isa_builds.wait(choice, CHILD_CODE, timeout=540)
    assert status == 0, stderr[-3000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["amx"] is False and got["bf16"] is False
    if choice != "portable":
        if not {"avx2", "fma", "f16c"} <= isa.raw_cpu_flags():
            pytest.skip("this CPU has no AVX2")
        assert got["int8_gemv"] == choice and got["capability"] == "AVX2"
        assert got["took_gemm"] == [True] * 6  # the AVX2 int8 GEMM, each format
        bound = 1 / 254 + 2**-9  # each activation within d_x / 2 = amax / 254, bf16 out
    else:
        assert got["int8_gemv"] == "" and got["capability"] == "DEFAULT"
        bound = 2**-9 + 1e-4  # the bf16 result's rounding, fp32 sums
    assert max(got["errors"].values()) < bound, got["errors"]
    import torch

    from vserve import cpu_ops

    quant = cpu_ops.load_quant()
    for w, qtype, x, gemv, gemm in torch.load(str(saved) + ".int8"):
        assert torch.equal(quant.gemv_avx2(x[:5], w, qtype, 512), gemv), qtype
        assert torch.equal(quant.gemm_avx2(x, w, qtype, 512), gemm), qtype
    native = attention(cpu_ops.load())
    for theirs, ours in zip(torch.load(saved), native):
        if choice != "portable":
            assert torch.equal(theirs, ours)
        else:
            torch.testing.assert_close(theirs.float(), ours.float(), rtol=2**-7, atol=1e-3)
    # the sampler: 8 lanes a vector on AVX2 and portable builds, 16 on AVX-512: the same
    # argmax, the same candidates, probabilities within fp32 sums' rounding, and (the CDF
    # within that rounding of this build's, no u near an edge) the same tokens
    native = sampled(cpu_ops.load_sampler())
    for i, (theirs, ours) in enumerate(zip(torch.load(str(saved) + ".sample"), native)):
        if i % 4 == 2:
            torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=0)
        else:
            assert torch.equal(theirs, ours), i
