"""For the tests that call the C++ kernels (vserve/cpu_ops): a skip where they cannot be built
(a kernel-build skip, which CI does not accept), and, as a plugin of tests/conftest.py, the
fixtures `ops` (the module; a test module may define its own) and `two_threads`."""

import shutil

import pytest
import torch

from vserve import cpu_ops

needs_kernels = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None or not cpu_ops.enabled_by_env(),
    reason="no C++ compiler, or VSERVE_CPU_OPS=0: the kernels cannot be built",
)


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "the CPU kernels failed to build (see the log)"
    return module


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
