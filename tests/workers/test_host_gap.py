"""When a worker's gap between two forwards runs parked (workers/host_gap.py): only with the next
request already there, more than one thread, and threads not pinned apart from the host work;
never on CUDA or with VSERVE_CPU_PARK=0. The parking itself: tests/cpu_ops/test_park.py."""

import pytest

from tests.support.cpu_kernels import needs_kernels
from vserve import cpu_ops
from vserve.workers.host_gap import HostGap, should_park


@pytest.mark.parametrize(
    "enabled, threads, pinned, ready, parks",
    [
        (True, 2, False, True, True),
        (True, 16, False, True, True),
        (False, 2, False, True, False),  # VSERVE_CPU_PARK=0
        (True, 1, False, True, False),  # no other thread to park
        (True, 2, True, True, False),  # a reserved core keeps the host work apart
        (True, 2, False, False, False),  # a wait for the step (sync): measured 0.7x parked
    ],
)
def test_should_park(enabled, threads, pinned, ready, parks):
    assert should_park(enabled, threads, pinned, ready) is parks


@needs_kernels
def test_cpu_gap_parks_when_it_pays(two_threads):
    gap = HostGap("cpu", enabled=True)
    assert gap.run(lambda parked: parked, next_ready=True) is True
    assert gap.run(lambda parked: parked, next_ready=False) is False
    gap.pinned = True
    assert gap.run(lambda parked: parked, next_ready=True) is False


def test_off_and_cuda_gaps_never_park(two_threads, monkeypatch):
    monkeypatch.setattr(cpu_ops, "load", lambda: pytest.fail("the kernels are not needed"))
    for gap in (HostGap("cpu", enabled=False), HostGap("cuda", enabled=True)):
        assert gap.run(lambda parked: parked, next_ready=True) is False


def test_env_turns_it_off(monkeypatch):
    from vserve import envs

    monkeypatch.setenv("VSERVE_CPU_PARK", "0")
    assert envs.read_env().cpu_park is False
    monkeypatch.delenv("VSERVE_CPU_PARK")
    assert envs.read_env().cpu_park is True
