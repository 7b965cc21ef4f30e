"""CPU placement: which cores the workers and the host work get, when a core is reserved, and
the user's overrides -- pure functions, no timing."""

import pytest

from vserve.host.placement import (
    RELEASE_BELOW,
    RESERVE_ABOVE,
    PlacementOverrides,
    choose_num_reserved,
    layer_shares,
    parse_cpu_list,
    parse_overrides,
    plan_placement,
)


def test_cpu_lists_parse_ranges_and_singles():
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpu_list("5") == (5,)
    assert parse_cpu_list("1,1,2") == (1, 2)
    for bad in ("", "3-1", "a", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_no_reservation_leaves_threads_unpinned_and_splits_the_thread_count():
    p = plan_placement(range(2), 1, 0)
    assert p.worker_cpus == ((),) and p.worker_threads == (2,) and p.host_cpus == ()
    assert not p.pins_host and p.num_reserved == 0
    assert plan_placement(range(8), 2, 0).worker_threads == (4, 4)


def test_one_reserved_core_takes_the_host_work_and_the_rest_go_to_the_worker():
    p = plan_placement([0, 1], 1, 1)
    assert p.host_cpus == (0,) and p.worker_cpus == ((1,),) and p.worker_threads == (1,)
    p = plan_placement([4, 5, 6, 7, 8, 9, 10], 2, 2)
    assert p.host_cpus == (4, 5)
    assert p.worker_cpus == ((6, 7, 8), (9, 10)) and p.worker_threads == (3, 2)


def test_a_reservation_never_takes_a_workers_last_core():
    assert plan_placement([0, 1], 2, 1).num_reserved == 0  # PP=2 on two cores
    assert plan_placement([0, 1, 2], 1, 5).num_reserved == 2
    assert plan_placement([0], 1, 1).worker_threads == (1,)


def test_tensor_parallel_ranks_keep_their_own_cores_without_a_reservation():
    p = plan_placement(range(8), 4, 0, pin_workers=True)  # TP=2 x PP=2 on eight cores
    assert p.worker_cpus == ((0, 1), (2, 3), (4, 5), (6, 7)) and p.worker_threads == (2,) * 4
    assert p.host_cpus == () and p.num_reserved == 0
    p = plan_placement(range(5), 2, 1, pin_workers=True)  # a reserved core still comes first
    assert p.host_cpus == (0,) and p.worker_cpus == ((1, 2), (3, 4))
    p = plan_placement(range(2), 4, 0, pin_workers=True)  # fewer cores than ranks: unpinned
    assert p.worker_cpus == ((),) * 4 and p.worker_threads == (1,) * 4


def test_unpinned_pp_stages_prefill_on_their_share_of_the_hosts_cores():
    """Prompt-heavy steps run on round(cores x the stage's share of the local layers) threads,
    never fewer than decode steps; pinned workers keep their own group's count."""
    shares = layer_shares((16, 2), range(2))
    assert shares == pytest.approx((16 / 18, 2 / 18))
    p = plan_placement([0, 1], 2, 0, layer_shares=shares)
    assert p.worker_threads == (1, 1) and p.prefill_threads == (2, 1)
    assert plan_placement(
        [0, 1], 2, 0, layer_shares=layer_shares((9, 9), range(2))
    ).prefill_threads == (1, 1)
    p = plan_placement(range(8), 2, 0, layer_shares=layer_shares((12, 4, 2), range(0, 2)))
    assert p.worker_threads == (4, 4) and p.prefill_threads == (6, 4)  # this host's ranks 0, 1
    assert layer_shares((18, 0), range(1, 2)) == ()  # one local rank: nothing to share
    assert layer_shares((0, 0), range(2)) == (0.5, 0.5)
    p = plan_placement(range(8), 2, 2, layer_shares=shares)  # pinned: no prefill threads
    assert p.prefill_threads == () and p.prefill_threads_of(0) == p.worker_threads[0]
    p = plan_placement([0, 1], 2, 0, PlacementOverrides(nobind=True), shares)
    assert p.prefill_threads == (2, 1)


def test_explicit_binding_wins_and_the_remaining_cpus_host():
    bind = PlacementOverrides(bind=((2, 3), (4, 5)))
    p = plan_placement(range(8), 2, 0, bind)
    assert p.worker_cpus == ((2, 3), (4, 5)) and p.worker_threads == (2, 2)
    assert p.host_cpus == (0, 1, 6, 7)
    p = plan_placement(range(2), 1, 0, PlacementOverrides(bind=((0, 1),)))
    assert p.host_cpus == () and not p.pins_host  # nothing left to host on
    with pytest.raises(ValueError, match="2 CPU groups for 1 local workers"):
        plan_placement(range(4), 1, 0, PlacementOverrides(bind=((0,), (1,))))
    with pytest.raises(ValueError, match="outside"):
        plan_placement(range(2), 1, 0, PlacementOverrides(bind=((3,),)))


def test_nobind_means_unpinned_whatever_the_reservation():
    p = plan_placement(range(4), 1, 1, PlacementOverrides(num_reserved=1, nobind=True))
    assert p.worker_cpus == ((),) and p.host_cpus == () and p.worker_threads == (4,)


def test_overrides_parse_from_the_environment_strings():
    assert parse_overrides(None, None) == PlacementOverrides()
    assert parse_overrides("auto", "auto") == PlacementOverrides()
    assert not parse_overrides("auto", None).fixed
    assert parse_overrides("1", None).num_reserved == 1
    assert parse_overrides("0", None).fixed
    assert parse_overrides(None, "nobind").nobind
    assert parse_overrides(None, "0-1|2-3").bind == ((0, 1), (2, 3))
    with pytest.raises(ValueError):
        parse_overrides("-1", None)


@pytest.mark.parametrize(
    "host,worker,current,expected",
    [
        (0.30, 1.0, 0, 1),  # tiny model: host work a third of the worker's
        (0.03, 1.0, 0, 0),  # large model: host work hardly shows
        (RESERVE_ABOVE, 1.0, 0, 1),
        (RESERVE_ABOVE * 0.99, 1.0, 0, 0),
        (0.15, 1.0, 1, 1),  # between the thresholds: keep what runs now
        (0.15, 1.0, 0, 0),
        (RELEASE_BELOW * 0.99, 1.0, 1, 0),  # well below: give the core back
        (0.5, 0.0, 1, 1),  # no worker figures: no change
    ],
)
def test_reservation_follows_host_work_with_hysteresis(host, worker, current, expected):
    assert choose_num_reserved(host, worker, current, 2, 1) == expected


def test_no_reservation_when_every_core_runs_a_worker():
    assert choose_num_reserved(1.0, 1.0, 0, num_cpus=2, num_workers=2) == 0
    assert choose_num_reserved(1.0, 1.0, 0, num_cpus=1, num_workers=1) == 0


def test_user_overrides_beat_the_measurements():
    assert choose_num_reserved(0.0, 1.0, 0, 4, 1, PlacementOverrides(num_reserved=2)) == 2
    assert choose_num_reserved(1.0, 1.0, 0, 4, 1, PlacementOverrides(num_reserved=0)) == 0
    assert choose_num_reserved(1.0, 1.0, 0, 4, 1, PlacementOverrides(nobind=True)) == 0
    assert choose_num_reserved(1.0, 1.0, 0, 4, 1, PlacementOverrides(bind=((1, 2, 3),))) == 0


class _FakeOS:
    """Clock, CPU times and pinning of made-up processes for `PlacementController`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = {}  # pid -> CPU seconds so far
        self.pinned = {}  # pid -> CPUs
        self.sent = []  # placements sent to the workers

    def hooks(self):
        return (
            lambda pid, cpus: self.pinned.__setitem__(pid, tuple(sorted(cpus))),
            lambda pid: self.cpu.get(pid, 0.0),
            lambda pid: (0, 1),
            lambda: self.now,
        )

    def controller(self, overrides=PlacementOverrides(), measure_self=True):
        from vserve.host.placement_control import PlacementController

        ctl = PlacementController(
            1, overrides, self.sent.append, measure_self, cpus=(0, 1), os_hooks=self.hooks()
        )
        ctl.worker_pids = [900]
        ctl.add_host_process(800)  # the front end
        return ctl

    def run_steps(self, ctl, num, step_s, host_cpu_per_step, worker_cpu_per_step, host_pid):
        for _ in range(num):
            self.now += step_s
            self.cpu[host_pid] = self.cpu.get(host_pid, 0.0) + host_cpu_per_step
            self.cpu[900] = self.cpu.get(900, 0.0) + worker_cpu_per_step
            ctl.step_done(step_s)


def test_controller_reserves_a_core_for_heavy_host_work_and_gives_it_back():
    import os

    from vserve.host.placement_control import WINDOW_STEPS

    fake = _FakeOS()
    ctl = fake.controller()
    assert ctl.adaptive and ctl.placement.num_reserved == 0 and not fake.sent
    # the front end uses 0.4 CPU-s per worker CPU-s: the next window reserves a core
    fake.run_steps(ctl, WINDOW_STEPS * 4, 0.005, 0.002, 0.005, 800)
    assert ctl.placement.num_reserved == 1 and len(fake.sent) == 1
    assert fake.sent[0].worker_cpus == ((1,),) and fake.sent[0].worker_threads == (1,)
    assert fake.pinned[800] == (0,) and fake.pinned[os.getpid()] == (0,)
    # between the thresholds nothing changes; well below, the core goes back
    fake.run_steps(ctl, WINDOW_STEPS * 4, 0.005, 0.00075, 0.005, 800)
    assert len(fake.sent) == 1
    fake.run_steps(ctl, WINDOW_STEPS * 4, 0.005, 0.0001, 0.005, 800)
    assert ctl.placement.num_reserved == 0 and len(fake.sent) == 2
    assert fake.pinned[800] == (0, 1)
    assert fake.sent[1].worker_cpus == ((),) and fake.sent[1].worker_threads == (2,)


def test_idle_windows_and_fixed_overrides_decide_nothing():
    from vserve.host.placement_control import WINDOW_STEPS

    fake = _FakeOS()
    ctl = fake.controller()
    for _ in range(WINDOW_STEPS * 4):  # the worker is busy a tenth of the time
        fake.now += 0.05
        fake.cpu[800] = fake.cpu.get(800, 0.0) + 0.01
        fake.cpu[900] = fake.cpu.get(900, 0.0) + 0.005
        ctl.step_done(0.005)
    assert ctl.placement.num_reserved == 0 and not fake.sent
    fixed = fake.controller(PlacementOverrides(num_reserved=0))
    assert not fixed.adaptive
    fake.run_steps(fixed, WINDOW_STEPS * 4, 0.005, 0.004, 0.005, 800)
    assert fixed.placement.num_reserved == 0 and not fake.sent


def test_a_fixed_reservation_pins_the_host_at_start_and_releases_it_at_the_end():
    fake = _FakeOS()
    ctl = fake.controller(PlacementOverrides(num_reserved=1))
    ctl.start()
    assert fake.pinned[800] == (0,)
    assert ctl.placement.worker_cpus == ((1,),)
    ctl.release()
    assert fake.pinned[800] == (0, 1)


def _thread_cpus(pid: int) -> set[tuple[int, ...]]:
    """The CPU sets of every thread of `pid`."""
    import os

    return {
        tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir(f"/proc/{pid}/task")
    }


def _thread_policies(pid: int) -> set[int]:
    """The scheduling policies of every thread of `pid`."""
    import os

    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_a_reserved_core_pins_worker_engine_core_and_front_end(tiny_model_dir, monkeypatch):
    """End to end with VSERVE_CPU_NUM_RESERVED=1: every worker thread on the last CPU, every
    engine-core and front-end thread on the first; the front end gets its CPUs back."""
    import os

    from vserve import LLM, SamplingParams
    from vserve.host.proc_tree import children, cmdline

    before = _thread_cpus(os.getpid())
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("VSERVE_CPU_NUM_RESERVED", "1")
    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        max_model_len=64,
        async_scheduling=True,
        distributed_executor_backend="mp",
    )
    try:
        out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8))
        assert len(out[0].outputs[0].token_ids) == 8
        core = llm.engine.client.engine.proc.pid
        workers = [k for k in children(core) if b"resource_tracker" not in cmdline(k)]
        assert len(workers) == 1
        assert _thread_cpus(workers[0]) == {cpus[1:]}
        assert _thread_cpus(core) == {cpus[:1]}
        assert _thread_cpus(os.getpid()) == {cpus[:1]}
        # async scheduling: the engine core's threads never preempt a forward on wakeup;
        # the workers (and this front end) keep the ordinary policy
        assert _thread_policies(core) == {os.SCHED_BATCH}
        assert _thread_policies(workers[0]) == {os.SCHED_OTHER}
        assert _thread_policies(os.getpid()) == {os.SCHED_OTHER}
    finally:
        llm.shutdown()
    assert _thread_cpus(os.getpid()) == before


@pytest.mark.slow  # another engine start-up; the fast tier keeps the pinning itself
def test_the_front_end_gets_its_cpus_back_when_the_engine_core_dies(tiny_model_dir, monkeypatch):
    """The engine core pins the front end beside itself and gives its CPUs back at shutdown;
    killed, it cannot: the front end restores them itself once it sees the core gone (before,
    it stayed on the host core until `shutdown()`)."""
    import os
    import signal
    import time

    from vserve import LLM, SamplingParams

    before = _thread_cpus(os.getpid())
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("VSERVE_CPU_NUM_RESERVED", "1")
    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        max_model_len=64,
        async_scheduling=True,
        distributed_executor_backend="mp",
    )
    try:
        llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4))
        assert _thread_cpus(os.getpid()) == {cpus[:1]}
        client = llm.engine.client
        os.kill(client.engine.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while client.dead_message is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.dead_message is not None, "the engine core's death went unnoticed"
        assert _thread_cpus(os.getpid()) == before
    finally:
        llm.shutdown()
    assert _thread_cpus(os.getpid()) == before


def _step(tokens_per_request: list[int]):
    from vserve.core.sched_output import SchedulerOutput

    so = SchedulerOutput.empty(1, set(), set())
    so.num_scheduled_tokens = {f"r{i}": n for i, n in enumerate(tokens_per_request)}
    so.total_num_scheduled_tokens = sum(tokens_per_request)
    return so


def test_a_worker_switches_to_its_prefill_threads_for_prompt_heavy_steps(monkeypatch):
    import torch

    from vserve.workers import worker as worker_mod

    assert worker_mod._prompt_heavy(_step([2048]))  # a prefill chunk
    assert worker_mod._prompt_heavy(_step([128, 1, 1]))
    assert not worker_mod._prompt_heavy(_step([1] * 256))  # decode, however many rows
    assert not worker_mod._prompt_heavy(_step([40]))  # too small to share
    assert not worker_mod._prompt_heavy(_step([4] * 64))  # drafts: a few tokens a row

    used = []
    monkeypatch.setattr(torch, "set_num_threads", used.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: used[-1] if used else 0)
    w = object.__new__(worker_mod.Worker)
    w._num_steps, w._fail_at, w._hang, w._delay_s = 0, None, False, 0.0
    w.runner = type("Runner", (), {"execute_model": lambda self, *a: None})()
    w.set_threads(1, 2)
    for so in (_step([2048]), _step([1] * 16), _step([1] * 16), _step([1900, 1])):
        w.execute_model(so)
    assert used == [1, 2, 1, 2]  # switched only when the kind of step changes
