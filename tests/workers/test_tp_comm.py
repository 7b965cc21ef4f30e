"""Tensor-parallel collectives: the shared-memory all-reduce sums like gloo (bitwise for fp32,
fp32-accumulated for bf16), gives every rank the same bits, reuses its two buffers safely over
many calls, splits tensors larger than a slot, leaves no file behind and times out instead of
hanging; the grid passes every request to every rank exactly once."""

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from vserve.distributed.grid import GridRank, local_ranks, tp_group_on_one_host
from vserve.executor.multiproc import free_port


def _init(rank: int, world: int, port: int):
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return dist


def _inputs(rank: int, call: int, numel: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def _reduce_rank(rank: int, world: int, port: int, shm_dir: str, one_core: bool, results):
    try:
        if one_core:  # every rank on the same core: a waiting rank must let the others run
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        dist = _init(rank, world, port)
        from vserve.distributed.shm_allreduce import ShmAllReduce

        # slots of 1 KiB: the 3000-element calls go in several chunks
        shm = ShmAllReduce(None, rank, world, slot_bytes=1024, shm_dir=shm_dir)
        assert os.listdir(shm_dir) == []  # unlinked once every rank mapped it
        digests = []
        for call, (numel, dtype) in enumerate(
            [(7, torch.float32), (3000, torch.float32), (640, torch.bfloat16)] * 4
        ):
            x = _inputs(rank, call, numel, dtype).view(-1, numel)
            got = shm.all_reduce(x)
            parts = [_inputs(r, call, numel, dtype) for r in range(world)]
            if dtype == torch.float32:
                want = parts[0].clone()
                for p in parts[1:]:
                    want += p
                ref = x.clone()
                dist.all_reduce(ref)  # gloo: the same sum (rounding aside)
                torch.testing.assert_close(got.view(-1), ref.view(-1))
            else:  # accumulated in fp32, in rank order, rounded once
                acc = parts[0].float()
                for p in parts[1:]:
                    acc += p.float()
                want = acc.to(dtype)
            assert got.shape == x.shape and got.dtype == dtype
            assert torch.equal(got.view(-1), want), (call, (got.view(-1) - want).abs().max())
            digests.append(got.view(-1).float().sum().item())
        shm.close()
        results.put((rank, digests))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _run(target, world: int, *args, timeout: float = 120):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, world, port, *args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=timeout) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize(
    "world, one_core", [(2, False), pytest.param(3, True, marks=pytest.mark.slow)]
)
def test_shm_all_reduce_sums_like_gloo_on_every_rank(world, one_core, tmp_path):
    """Two ranks on their own cores (truly concurrent), three sharing one core (preempted
    anywhere, the third slot and a three-way sum). With the ranks on one core this took
    minutes when a waiting rank spun 4096 polls before each sched_yield; it now sleeps after a
    short spin."""
    got = _run(_reduce_rank, world, str(tmp_path), one_core)
    for rank in range(world):
        assert isinstance(got[rank], list), got[rank]
    assert all(got[r] == got[0] for r in range(world))  # the same bits everywhere
    assert os.listdir(tmp_path) == []


def _late_rank(rank: int, world: int, port: int, shm_dir: str, results) -> None:
    try:
        dist = _init(rank, world, port)
        from vserve.distributed.shm_allreduce import ShmAllReduce

        shm = ShmAllReduce(None, rank, world, slot_bytes=1024, timeout_s=0.5, shm_dir=shm_dir)
        if rank == 0:
            try:
                shm.all_reduce(torch.ones(4))
                results.put((rank, "no timeout"))
            except TimeoutError as e:
                results.put((rank, str(e)))
        else:
            results.put((rank, "absent"))
        dist.barrier()  # rank 1 never joins the all-reduce: it stays here
    except BaseException:
        results.put((rank, traceback.format_exc()))


@pytest.mark.slow
def test_shm_all_reduce_times_out_when_a_rank_never_arrives(tmp_path):
    got = _run(_late_rank, 2, str(tmp_path))
    assert "ranks [1] did not arrive" in got[0], got[0]


def test_shm_segment_name_from_a_peer_is_checked(tmp_path):
    from vserve.distributed.shm_allreduce import _checked_path

    ok = str(tmp_path / "vserve-tp-abc")
    assert _checked_path(ok, str(tmp_path)) == ok
    for bad in ["/etc/passwd", str(tmp_path / "other"), str(tmp_path / "sub" / "vserve-tp-x")]:
        with pytest.raises(ValueError):
            _checked_path(bad, str(tmp_path))


@pytest.mark.parametrize("pp,tp", [(1, 1), (1, 2), (2, 2), (3, 2), (2, 4)])
def test_grid_passes_each_request_to_every_rank_once(pp, tp):
    ranks = [GridRank(r, pp, tp) for r in range(pp * tp)]
    received = {0: 1}  # rank 0 from the engine core
    for g in ranks:
        assert (g.request_source is None) == (g.rank == 0)
        for dst in g.request_targets:
            assert ranks[dst].request_source == g.rank
            received[dst] = received.get(dst, 0) + 1
    assert received == {r: 1 for r in range(pp * tp)}
    samplers = [g.rank for g in ranks if g.is_sampler]
    assert samplers == [(pp - 1) * tp]
    # every first-stage rank but the sampler takes the ids from it
    assert sorted(ranks[0].feedback_ranks + samplers[:1] * (pp == 1)) == list(range(tp))
    for g in ranks:
        assert GridRank.of(g.pp_rank, g.tp_rank, pp, tp) == g
        assert g.peer(g.pp_rank) == g.rank


def test_hosts_split_the_grid_and_tp_groups_know_whether_they_span_hosts():
    assert list(local_ranks(4, 2, 1)) == [2, 3]
    with pytest.raises(ValueError, match="multiple of nnodes"):
        local_ranks(3, 2, 0)
    # pp=2 x tp=2 on two hosts: each host holds a whole stage
    assert all(tp_group_on_one_host(GridRank(r, 2, 2), 2) for r in range(4))
    # pp=1 x tp=2 on two hosts: the TP group spans them (gloo)
    assert not any(tp_group_on_one_host(GridRank(r, 1, 2), 2) for r in range(2))
