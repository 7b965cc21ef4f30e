"""Pipeline-parallel communication: requests travel down the pipeline without holding a stage
behind a later one, and stage 0 reads the last stage's ids only when it needs them."""

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from vserve.distributed.grid import GridRank
from vserve.executor.multiproc import free_port

WORLD = 3
AHEAD = 5  # requests rank 0 passes on before the later ranks take any (an engine keeps
# at most pp + 1 steps in flight)
MORE = 40  # then many more: the sends rank 0 keeps track of stay bounded


def _rank(rank: int, port: int, sent, results) -> None:
    """Both checks on one pipeline of WORLD spawned ranks (each start imports torch): what
    later ranks took while rank 0 ran ahead, then the framed messages each rank received."""
    try:
        from vserve.workers.pp_comm import PPComm

        grid = GridRank(rank, WORLD)
        comm = PPComm(grid, "127.0.0.1", port, torch.device("cpu"), 8, torch.float32)
        ahead = _run_ahead(comm, rank, sent)
        framed = _framed(comm, grid)
        comm.close()  # a later rank's posted receive takes rank 0's goodbye frame
        results.put((rank, (ahead, framed)))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _run_ahead(comm, rank: int, sent) -> list[str]:
    """Rank 0 passes requests on before any later rank takes one; the later ranks' takes."""
    if rank == 0:
        for i in range(AHEAD):
            comm.pass_request(f"request {i}".encode() * (i + 1))
        sent.set()  # before any later rank took a single request
        for i in range(AHEAD, AHEAD + MORE):
            comm.pass_request(f"request {i}".encode() * (i + 1))
        got = []
    else:
        # a later stage busy with an older step: it takes nothing until rank 0 is done
        if not sent.wait(timeout=60):
            raise AssertionError("rank 0 was held until later ranks took its requests")
        got = []
        for _ in range(AHEAD + MORE):
            got.append(comm.pass_request(None).decode())
            # the next request's frame is received into a receive posted before it is sent
            assert comm._next_request is not None
    assert len(comm._inflight) <= comm._max_inflight
    return got


def _framed(comm, grid) -> str:
    """Requests of sizes around a frame's down the pipeline, each returned reversed by the
    last stage: every rank gets every byte ("ok"), else what it got."""
    from vserve.workers.pp_comm import FRAME_BYTES

    sizes = [0, 1, FRAME_BYTES - 8, FRAME_BYTES - 7, 3 * FRAME_BYTES + 5]
    messages = [bytes((i * 7 + n) % 251 for n in range(size)) for i, size in enumerate(sizes)]
    got = []
    for m in messages:  # requests down, replies back: frames, and the rest beyond one
        if grid.rank == 0:
            comm.pass_request(m)
            got.append(comm.recv_reply())
        else:
            got.append(comm.pass_request(None))
            if grid.is_sampler:
                comm.send_reply(got[-1][::-1])
    want = [m[::-1] for m in messages] if grid.rank == 0 else messages
    return "ok" if got == want else f"got sizes {[len(g) for g in got]}"


@pytest.fixture(scope="module")
def pipeline():
    """{rank: (what it took while rank 0 ran ahead, its framed messages' verdict)}."""
    ctx = mp.get_context("spawn")
    sent, results = ctx.Event(), ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, sent, results), daemon=True) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=180) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, result in got.items():
        assert not isinstance(result, str), f"rank {rank}:\n{result}"
    return got


def test_requests_and_replies_of_any_size_pass_in_frames(pipeline):
    assert {rank: framed for rank, (_, framed) in pipeline.items()} == {
        r: "ok" for r in range(WORLD)
    }


class _FakeComm:
    """pass_request hands out queued requests; post_recv_hidden records the posting order."""

    def __init__(self, requests: list[bytes]) -> None:
        import queue

        self.requests: queue.Queue = queue.Queue()
        for r in requests:
            self.requests.put(r)
        self.events: list[str] = []

    def pass_request(self, data):
        item = self.requests.get(timeout=30)
        if isinstance(item, BaseException):
            raise item
        return item

    def post_recv_hidden(self, so):
        self.events.append(f"posted {so.step_id}")
        return lambda: ("hidden", so.step_id)


def _execute(step_id: int, tokens: int):
    from vserve.core.sched_output import SchedulerOutput
    from vserve.workers import messages as wire

    so = SchedulerOutput.empty(step_id, set(), set())
    so.total_num_scheduled_tokens = tokens
    return wire.encode(wire.Execute(so, False))


def test_prefetch_posts_hidden_receives_before_the_stage_takes_the_step():
    """A later CPU stage's requests are taken on their own thread, which posts the receive of
    each non-empty step's hidden states at once: three requests ahead of the main loop, all
    three receives are posted before it takes the first."""
    from vserve.workers import messages as wire
    from vserve.workers.pp_prefetch import RequestPrefetch

    comm = _FakeComm([_execute(1, 4), _execute(2, 0), _execute(3, 2), wire.encode(wire.Shutdown())])
    prefetch = RequestPrefetch(comm, post_hidden=True)
    prefetch.thread.join(timeout=30)  # the main loop is still busy with an older step
    assert comm.events == ["posted 1", "posted 3"]  # the empty step 2 has no input
    first = prefetch.next()
    assert isinstance(first.message, wire.Execute) and first.hidden() == ("hidden", 1)
    assert prefetch.next().hidden is None
    assert prefetch.next().hidden() == ("hidden", 3)
    assert isinstance(prefetch.next().message, wire.Shutdown)


def test_prefetch_hands_errors_to_the_main_loop():
    from vserve.workers.pp_prefetch import RequestPrefetch

    gone = RequestPrefetch(_FakeComm([EOFError("rank 0 went away")]), post_hidden=True)
    assert isinstance(gone.next().taken_error, EOFError)
    bad = RequestPrefetch(_FakeComm([b"\x01not a request"]), post_hidden=True)
    assert bad.next().request_error is not None

    class _CannotPost(_FakeComm):
        def post_recv_hidden(self, so):
            raise RuntimeError("connection closed by the previous rank")

    # a receive that cannot be posted ends the thread with an item, never a silent hang
    stuck = RequestPrefetch(_CannotPost([_execute(1, 4)]), post_hidden=True)
    assert "connection closed" in str(stuck.next().request_error)


def test_requests_pass_down_the_pipeline_without_waiting(pipeline):
    expected = [(f"request {i}" * (i + 1)) for i in range(AHEAD + MORE)]
    for rank in range(1, WORLD):
        assert pipeline[rank][0] == expected, pipeline[rank][0]
    assert pipeline[0][0] == []


class _Batch:
    """The part of InputBatch that write-back touches."""

    layout_version = 0

    def __init__(self) -> None:
        self.written: list[tuple[str, int, int, int]] = []

    def write_token(self, req_id, epoch, pos, token) -> None:
        self.written.append((req_id, epoch, pos, token))


def _stage0_queue(pp: int):
    """Stage 0 of a pp-stage pipeline after steps 1..pp, one group of requests each; every
    entry records when its ids were waited for."""
    from vserve.workers.feedback import Feedback, FeedbackQueue

    queue, waited = FeedbackQueue(max_pending=pp), []
    for step in range(1, pp + 1):
        req_id = f"group{step}"
        queue.items.append(
            Feedback.of(
                step,
                torch.tensor([100 + step]),
                [(req_id, 1, 5)],
                wait_fn=lambda s=step: waited.append(s),
            )
        )
    return queue, waited


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_stage0_waits_only_for_the_ids_a_step_reads(pp):
    queue, waited = _stage0_queue(pp)
    batch = _Batch()
    # step pp+1 carries group 1 again: it reads step 1's id (position 5), nothing newer
    queue.settle(batch, {"group1": (1, 5, 6)})
    assert waited == [] and queue.source.step_id == 1
    assert queue.source.device_ids().tolist() == [101] and waited == [1]
    assert len(queue.items) == pp  # the newer steps' ids stay pending
    # step pp+2 carries group 2: step 1's ids go to the host, steps 3.. stay pending
    queue.settle(batch, {"group2": (1, 5, 6)})
    assert batch.written == [("group1", 1, 5, 101)]
    assert queue.source.step_id == 2 and waited == [1]


def test_stage0_writes_back_beyond_max_pending_and_wrong_epochs_do_not_count():
    from vserve.workers.feedback import FeedbackQueue

    FeedbackQueue(max_pending=3).settle(_Batch(), {"a": (1, 0, 4)})  # nothing pending yet
    queue, waited = _stage0_queue(3)
    batch = _Batch()
    queue.items.popleft()
    queue.settle(batch, {"group2": (1, 5, 6)})  # fewer entries than max_pending
    assert [fb.step_id for fb in queue.items] == [2, 3] and batch.written == []
    queue, waited = _stage0_queue(3)
    queue.settle(batch, {"group3": (2, 5, 6)})  # another epoch of group3: reads nothing
    assert waited == [] and len(queue.items) == 3
    from vserve.workers.feedback import Feedback

    queue.items.append(
        Feedback.of(4, torch.tensor([104]), [("group4", 1, 5)], wait_fn=lambda: waited.append(4))
    )
    queue.settle(batch, {})
    assert waited == [1] and [fb.step_id for fb in queue.items] == [2, 3, 4]


def test_without_pp_all_but_the_newest_are_written_back():
    from vserve.workers.feedback import Feedback, FeedbackQueue

    queue, batch = FeedbackQueue(), _Batch()
    for step in (1, 2, 3):
        queue.items.append(Feedback.of(step, torch.tensor([step]), [("a", 1, step)]))
    queue.settle(batch, None)
    assert [fb.step_id for fb in queue.items] == [3] and len(batch.written) == 2


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on port."""
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            addr, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_rendezvous_store_listens_on_master_addr_only():
    """c10d's TCPStore alone listens on every interface (:: or 0.0.0.0) whatever host it is
    given; the store of a pipeline must listen on --master-addr only (here loopback)."""
    from vserve.workers.pp_comm import PPComm

    port = free_port()
    comm = PPComm(GridRank(0, 1), "127.0.0.1", port, torch.device("cpu"), 8, torch.float32)
    try:
        assert _listening(port) == ["0100007F"]  # 127.0.0.1, little-endian hex
    finally:
        comm.close()
    assert _listening(port) == []
