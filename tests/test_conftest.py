"""tests/conftest.py's CI hook: in CI, a skip because the C++ kernels cannot be built fails;
skips for CPU features or devices the machine lacks do not."""

import pytest

from tests.conftest import is_kernel_build_skip

BUILD_REASONS = [
    "no C++ compiler: the kernels cannot be built",
    "no C++ compiler: the quantized kernels cannot be built",
    "no C++ compiler: the eager path runs instead",
    "no C++ compiler: the torch sampler runs instead",
    "the quantized CPU kernels cannot be built here",
]
LEGITIMATE_REASONS = [
    "the int8 paths need AVX512-VNNI",
    "the tile GEMM needs AMX (amx_tile, amx_bf16)",
    "the AVX2 int8 gemv needs AVX2, FMA, F16C",
    "bf16 instructions: the exact matmul runs in bf16",
    "no native bf16 on this CPU: no packed linears",
    "no bf16 instructions: dtype=auto resolves to float32",
    "needs a CUDA device",
    "could not import 'triton': No module named 'triton'",
    "needs two CPUs",
    "torch without MKL",
]

SKIPS = """
import pytest

@pytest.mark.skipif(True, reason="no C++ compiler: the kernels cannot be built")
def test_no_compiler():
    pass

@pytest.fixture
def kernel():
    pytest.skip("the quantized CPU kernels cannot be built here")

def test_build_error(kernel):
    pass

@pytest.mark.skipif(True, reason="the int8 paths need AVX512-VNNI")
def test_no_vnni():
    pass

def test_no_cuda():
    pytest.skip("needs a CUDA device")

@pytest.mark.xfail(reason="the kernels cannot be built", run=False)
def test_xfail():
    pass
"""


@pytest.mark.parametrize("reason", BUILD_REASONS)
def test_kernel_build_skips_are_recognised(reason):
    assert is_kernel_build_skip(reason)
    assert is_kernel_build_skip(f"Skipped: {reason}")  # as a report's longrepr holds it


@pytest.mark.parametrize("reason", LEGITIMATE_REASONS)
def test_missing_features_and_devices_are_not(reason):
    assert not is_kernel_build_skip(reason)


@pytest.mark.parametrize("ci", ["true", "1", None, "false"])
def test_ci_fails_only_kernel_build_skips(pytester, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makepyfile(SKIPS)
    # the plugins pyproject.toml leaves out (the inner run reads no pyproject.toml): pytester
    # restores sys.modules after each run, so they would import again every time (3 s)
    quiet = ("-p", "no:schemathesis", "-p", "no:hypothesispytest")
    result = pytester.runpytest("-p", "tests.conftest", "-p", "no:cacheprovider", *quiet)
    if ci in ("true", "1"):
        result.assert_outcomes(errors=2, skipped=2, xfailed=1)
        result.stdout.fnmatch_lines(["*CI is set, and the C++ kernels were not built*"])
    else:
        result.assert_outcomes(skipped=4, xfailed=1)
