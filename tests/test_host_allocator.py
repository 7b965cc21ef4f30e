"""The worker's allocator keeps freed blocks warm, also those above glibc's 32 MiB mmap
ceiling (a step's fp32 logits over a 262k vocabulary at batch 32 are 33.5 MiB): a block
allocated again after a free must not page-fault anew. Counted in page faults, not time."""

import subprocess
import sys

import pytest

_PROBE = """
import resource, torch
from workers.device import tune_host_allocator
if {tune}:
    tune_host_allocator()
def faults(num_bytes):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(num_bytes // 4, dtype=torch.float32)
    t.fill_(1.0)                       # touch every page
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
size = 40 * 1024 * 1024
faults(size)                           # the first time the pages are new either way
print(min(faults(size) for _ in range(3)))
"""


def _refaults(tune: bool) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(tune=tune)], check=True,
                         capture_output=True, text=True)
    return int(out.stdout.split()[-1])


def test_blocks_above_the_mmap_ceiling_stay_warm():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc allocator")
    pages = 40 * 1024 * 1024 // 4096
    assert _refaults(tune=False) > pages // 2      # the probe sees glibc's default
    assert _refaults(tune=True) < pages // 20
