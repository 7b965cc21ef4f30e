"""cpu_ops.parked (vserve/cpu_ops/park.h): fn() on the calling thread while the other threads of
torch's OpenMP pool sleep. Its value and its exceptions come back as they are, torch ops inside
run on this thread alone, and the parked threads use no CPU: with OpenMP threads that would
otherwise spin without end, a sleep outside the park burns a core and a sleep in it does not."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.cpu_kernels import needs_kernels

pytestmark = needs_kernels


def test_returns_the_value_of_one_call(ops, two_threads):
    calls = []
    assert ops.parked(lambda: calls.append(1) or ("value", 7)) == ("value", 7)
    assert calls == [1]


def test_an_exception_comes_back_with_its_type(ops, two_threads):
    class Marked(Exception):
        pass

    def fail():
        raise Marked("from inside")

    with pytest.raises(Marked, match="from inside"):
        ops.parked(fail)
    with pytest.raises(EOFError):  # what the worker loop catches for a closed pipe
        ops.parked(lambda: (_ for _ in ()).throw(EOFError()))
    assert ops.parked(lambda: 3) == 3  # the pool still works after


def test_torch_ops_inside_match_outside(ops, two_threads):
    """The same product inside a park, to fp32 summation's rounding: MKL may split a sum of
    256 products differently from one call to the next (seen held to AVX2, 1 element in
    32768 off by 1e-5 of 16), which is no fault of the park."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=gen), torch.randn(512, 256, generator=gen)
    expected = torch.nn.functional.linear(x, w)
    got = ops.parked(lambda: torch.nn.functional.linear(x, w))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_nested_and_single_thread_calls_just_run(ops, two_threads):
    assert ops.parked(lambda: ops.parked(lambda: 5)) == 5
    torch.set_num_threads(1)
    assert ops.parked(lambda: 6) == 6


SPIN = textwrap.dedent(
    """
    import time
    import torch
    from vserve import cpu_ops
    torch.set_num_threads(2)
    ops = cpu_ops.load()
    x = torch.empty(1 << 22)

    def asleep():  # CPU time of the process while this thread sleeps 0.4 s
        start = time.process_time()
        time.sleep(0.4)
        return time.process_time() - start

    x.exp_()  # one parallel region (ATen's): the other thread spins through the sleep
    spinning = asleep()
    x.exp_()
    print((spinning, ops.parked(asleep)))
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 threads")
def test_parked_threads_use_no_cpu(ops):
    """Relative to the same sleep without a park (the other thread spins through it: up to
    0.4 CPU-s on an idle core, less on a loaded host), not to a wall-clock window. Both in
    one process, the spinning sleep first."""
    env = dict(os.environ, OMP_WAIT_POLICY="active", GOMP_SPINCOUNT="infinite")
    out = subprocess.run(
        [sys.executable, "-c", SPIN], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    spinning, parked = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 -- our child
    assert spinning > 0.02, spinning  # the measure sees a spinning thread at all
    assert parked < 0.25 * spinning, (parked, spinning)


def test_unpark_outside_a_park_does_nothing(ops, two_threads):
    ops.unpark()
    assert ops.parked(lambda: (ops.unpark(), ops.unpark(), 4)[2]) == 4  # twice: once counts
    assert ops.parked(lambda: 5) == 5  # the next park sleeps again (its own state)
    assert ops.parked(lambda: ops.parked(lambda: (ops.unpark(), 6)[1])) == 6  # nested: the outer


def test_a_raise_after_unpark_leaves_the_pool_working(ops, two_threads):
    def fail():
        ops.unpark()
        raise KeyError("after the wake")

    for _ in range(20):
        with pytest.raises(KeyError):
            ops.parked(fail)
    x = torch.randn(256, 256)
    torch.testing.assert_close(ops.parked(lambda: x @ x), x @ x)


UNPARK = textwrap.dedent(
    """
    import time
    import torch
    from vserve import cpu_ops
    torch.set_num_threads(2)
    ops = cpu_ops.load()
    torch.empty(1 << 22).exp_()

    def host_work():  # asleep 0.3 s, unparked, asleep 0.3 s more: CPU time of each half
        a = time.process_time()
        time.sleep(0.3)
        b = time.process_time()
        ops.unpark()
        time.sleep(0.3)
        return b - a, time.process_time() - b

    print(ops.parked(host_work))
    """
)


@pytest.mark.slow  # a child process; the fast tier keeps the park's own measure
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 threads")
def test_unpark_wakes_the_team_before_the_work_ends():
    """After `unpark` the other thread spins (ready for the forward) while fn still runs;
    before it, it sleeps."""
    out = subprocess.run(
        [sys.executable, "-c", UNPARK], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    asleep, woken = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 -- our own child
    assert woken > 0.02, woken  # the woken thread spun through the second sleep
    assert asleep < 0.25 * woken, (asleep, woken)  # relative: a loaded host slows both
