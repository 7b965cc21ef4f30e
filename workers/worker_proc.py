"""The worker process: one rank of the TP x PP grid (a pipeline stage, or one TP shard of
it), driven by requests from the engine core.

Only rank 0 talks to the engine core (two pipes); every request travels on from rank to rank
over torch.distributed (`PPComm.pass_request`), so ranks may live on other hosts. Each step's
result comes from the sampling rank (TP rank 0 of the last stage): with PP or CUDA a reply
thread waits for the host copy of the sampled ids and sends it, so the main loop takes the
next request at once (a single CPU stage replies from its main loop, first thing in the gap
before the next step, which workers/host_gap.py may run parked). A rank that fails reports its error
(rank 0 and the sampling rank carry the message to the engine) and exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import traceback
from dataclasses import dataclass

from vserve.envs import ENV
from vserve.host import heap
from vserve.host.affinity import available_cpus, pin_process
from vserve.host.lifeline import exit_with_parent
from vserve.host.policy import HostPolicy
from vserve.workers import messages as wire
from vserve.workers.pp_prefetch import Prefetched, RequestPrefetch
from vserve.workers.reply_pipe import ReplyPipe

logger = logging.getLogger("vserve.worker")

IDLE_TRIM_S = 1.0  # no request for this long: the worker is idle and trims its heap
REPLY_DRAIN_S = 10.0  # an exiting rank 0 waits this long for the engine core to read its replies


@dataclass(frozen=True)
class RankSetup:
    rank: int  # in the grid: pp_rank * tensor_parallel_size + tp_rank
    world_size: int  # pipeline x tensor parallel sizes
    master_addr: str
    master_port: int
    num_threads: int | None = None
    cpus: tuple[int, ...] = ()  # CPUs for every thread of this rank; () = unpinned
    prefill_threads: int | None = None  # torch threads in prompt-heavy steps (PP placement)


def worker_main(runner_config, setup: RankSetup, req_conn=None, resp_conn=None) -> None:
    """Entry point of a spawned worker process (or of `vserve worker` on another host)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end owns Ctrl-C and shuts us down
    parent = multiprocessing.parent_process()
    exit_with_parent(parent.pid if parent is not None else os.getppid())
    logging.basicConfig(
        level=ENV.log_level, format=f"%(asctime)s worker{setup.rank} %(levelname)s %(message)s"
    )
    try:
        loop = _RankLoop(runner_config, setup, req_conn, resp_conn)
    except BaseException:
        _report_startup_failure(resp_conn, setup.rank)
        sys.exit(1)
    code = loop.run()
    loop.close_replies()
    os._exit(code)


def _report_startup_failure(resp_conn, rank: int) -> None:
    message = f"worker rank {rank} failed to start:\n{traceback.format_exc()}"
    logger.error(message)
    if resp_conn is not None:
        try:
            resp_conn.send_bytes(wire.encode(wire.Error(message)))
        except OSError:
            pass


class _RankLoop:
    def __init__(self, runner_config, setup: RankSetup, req_conn, resp_conn) -> None:
        import torch

        from vserve.distributed.grid import GridRank, tp_group_on_one_host
        from vserve.workers.host_gap import HostGap
        from vserve.workers.pp_comm import PPComm
        from vserve.workers.worker import Worker

        self.setup = setup
        self.rank, self.world = setup.rank, setup.world_size
        grid = GridRank(setup.rank, runner_config.pp_size, runner_config.tp_size)
        assert grid.world_size == self.world, (grid, self.world)
        self.is_sampler = grid.is_sampler
        self.req_conn = req_conn
        self.busy = False  # a request came since the heap was last trimmed
        self.pp = None
        if self.world > 1:
            from vserve.models.hf_config import load_hf_config

            hf = load_hf_config(runner_config.model_path)
            dtype = {
                "float32": torch.float32,
                "bfloat16": torch.bfloat16,
                "float16": torch.float16,
            }[runner_config.dtype]
            self.pp = PPComm(
                grid,
                setup.master_addr,
                setup.master_port,
                torch.device(runner_config.device),
                hf.hidden_size,
                dtype,
                tp_shm=tp_group_on_one_host(grid, runner_config.nnodes),
            )
        self.all_cpus = available_cpus()
        if setup.cpus:
            pin_process(os.getpid(), setup.cpus)
        self.worker = Worker(runner_config, self.pp, setup.num_threads, setup.prefill_threads)
        host = HostPolicy.worker(runner_config.device, self.rank, grid.pp_size, self.world)
        # a rank fed by another takes its requests ahead of its forward (and a later stage
        # posts the receive of its hidden states then: vserve.workers.pp_prefetch)
        self.prefetch = (
            RequestPrefetch(self.pp, post_hidden=not grid.is_first_stage)
            if host.prefetch_requests and self.pp is not None
            else None
        )
        # the ids are on the host when a step returns: reply at once instead of waking the
        # reply thread (which waits for the GIL while the next step runs)
        self.inline_replies = host.inline_replies
        self.held_reply = None  # the step's output, sent first thing in the next gap
        self.gap = HostGap(runner_config.device, enabled=host.park_gaps)
        self.gap.pinned = bool(setup.cpus)
        # rank 0's replies: written without ever waiting for the engine core to read them,
        # which may be writing the next request at the same time (workers/reply_pipe.py)
        self.reply_pipe = ReplyPipe(resp_conn) if resp_conn is not None else None
        self.replies: queue.Queue = queue.Queue()
        self.reply_thread = threading.Thread(
            target=self._reply_loop, daemon=True, name="vserve-reply"
        )
        self.reply_thread.start()

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> int:
        while True:
            try:
                msg, hidden = self.gap.run(self._between_steps, self._next_ready())
            except (EOFError, OSError, RuntimeError):
                return 0 if self.rank else 1  # engine core or rank 0 went away
            try:
                if isinstance(msg, BaseException):
                    raise msg
                if isinstance(msg, wire.Shutdown):
                    self._close()
                    return 0
                self._handle(msg, hidden)
            except BaseException:
                message = f"worker rank {self.rank}: {traceback.format_exc()}"
                logger.error(message)
                if self.rank == 0 or self.is_sampler:  # the ranks rank 0 listens to
                    self.replies.put(("error", message))
                self.replies.put(None)
                self.reply_thread.join(timeout=10)
                return 1

    def _between_steps(self, parked: bool) -> tuple[wire.WorkerRequest | BaseException, object]:
        """The reply held back from the last step, the next request, and (`parked`: the other
        threads asleep, workers/host_gap.py) a step's inputs. A reply that cannot be made, a
        request that does not decode or inputs that fail come back as the exception (not
        raised: the loop reports it as a failed step, where a raise would end the loop as if
        the engine core had gone)."""
        if self.held_reply is not None:
            out, self.held_reply = self.held_reply, None
            try:
                reply = wire.encode(wire.Out(out.get()))
            except BaseException as e:  # the step's failure, reported as before
                return e, None
            self._send(reply)  # (an OSError: the engine core is gone)
        data, hidden = self._next_request()
        try:
            msg = data.message if isinstance(data, Prefetched) else None
            if msg is None:
                if isinstance(data, Prefetched):
                    raise data.request_error or RuntimeError("no request")
                msg = wire.decode_request(data)  # typed: another host may have sent it
            if parked and isinstance(msg, wire.Execute):
                # the team wakes under the preparation (the engine core has had the reply
                # the gap began with): it is spinning again when the forward starts
                self.gap.wake()
                self.worker.prepare(msg.so)
        except BaseException as e:
            return e, hidden
        return msg, hidden

    def _next_ready(self) -> bool:
        """The engine core's next request is already here (a single rank only)."""
        return self.world == 1 and self.req_conn is not None and self.req_conn.poll(0)

    def _next_request(self) -> tuple[bytes | Prefetched, object]:
        """The next request's bytes (or, on a later CPU stage, its prefetched form), and the
        call that waits for its posted hidden states (None: not posted)."""
        if self.prefetch is not None:
            item = self.prefetch.next()
            if isinstance(item.taken_error, (EOFError, OSError, RuntimeError)):
                raise item.taken_error
            if item.taken_error is not None:  # the previous rank is gone, whatever the type
                raise RuntimeError(f"pipeline request lost: {item.taken_error!r}")
            return item, item.hidden
        data = None
        if self.rank == 0:
            if self.busy and not self.req_conn.poll(IDLE_TRIM_S):
                heap.trim()  # idle: the heap's free pages go back until the next step
                self.busy = False
            data = self.req_conn.recv_bytes()
            self.busy = True
        return (self.pp.pass_request(data) if self.pp else data), None

    def _handle(self, msg: wire.WorkerRequest, hidden=None) -> None:
        if isinstance(msg, wire.Execute):
            out = self.worker.execute_model(msg.so, msg.defer_sampling, hidden)
            if not msg.defer_sampling:  # a deferred step replies after its Sample request
                self._expect_reply(out)
        elif isinstance(msg, wire.Sample):
            self._expect_reply(self.worker.sample_tokens(msg.step_id, msg.grammar_bitmask))
        elif isinstance(msg, wire.Place):
            self._place(msg.per_rank)
        elif isinstance(msg, wire.Load):
            self.worker.load_model()
            self._direct_reply(None)
        elif isinstance(msg, wire.NumKvBlocks):
            value = self.worker.num_kv_blocks()
            self._direct_reply(self.pp.min_over_ranks(value) if self.pp else value)
        elif isinstance(msg, wire.InitKvCache):
            self.worker.init_kv_cache(msg.num_blocks)
            heap.startup_over()  # this process's start-up is over: no GC walks the model again
            self._direct_reply(None)
        else:
            raise ValueError(f"unknown worker request {type(msg).__name__}")

    def _place(self, per_rank: dict[int, tuple[int, int, tuple[int, ...]]]) -> None:
        """Threads and CPUs chosen by the engine's placement controller; () = any CPU."""
        if self.rank not in per_rank:  # a stage on another host keeps its own placement
            return
        num_threads, prefill_threads, cpus = per_rank[self.rank]
        self.worker.set_threads(num_threads, prefill_threads)
        pin_process(os.getpid(), cpus or self.all_cpus)
        self.gap.pinned = bool(cpus)

    def _expect_reply(self, out) -> None:
        if self.inline_replies:  # sent first thing in the gap, parked with it
            self.held_reply = out
        elif self.is_sampler:
            self.replies.put(("local", out))
        elif self.rank == 0:
            self.replies.put(("remote", None))

    def _direct_reply(self, value) -> None:
        if self.rank == 0:
            self._send(wire.encode(wire.Ok(value)))

    # -- replies ---------------------------------------------------------------------------------
    def _reply_loop(self) -> None:
        while True:
            item = self.replies.get()
            if item is None:
                return
            kind, payload = item
            try:
                if kind == "local":
                    data = wire.encode(wire.Out(payload.get()))
                elif kind == "remote":
                    data = self.pp.recv_reply()
                else:
                    data = wire.encode(wire.Error(payload))
                if self.rank == 0:
                    self._send(data)
                else:
                    self.pp.send_reply(data)
            except BaseException:
                logger.error("worker rank %d reply failed:\n%s", self.rank, traceback.format_exc())
                if self.rank == 0:
                    self._send(wire.encode(wire.Error(traceback.format_exc())))
                    self.close_replies()
                os._exit(1)

    def _send(self, data: bytes) -> None:
        self.reply_pipe.send(data)

    def close_replies(self) -> None:
        """Deliver what is still queued for the engine core (a final error) before exiting."""
        if self.reply_pipe is not None:
            self.reply_pipe.close(timeout=REPLY_DRAIN_S)

    def _close(self) -> None:
        self.replies.put(None)
        self.reply_thread.join(timeout=10)
        if self.prefetch is not None:  # it ends after passing on the shutdown
            self.prefetch.thread.join(timeout=10)
        if self.pp is not None:
            self.pp.close()
