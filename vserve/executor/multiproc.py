"""Workers in their own processes (spawned), one per rank of the TP x PP grid on this host.

The engine core sends each `SchedulerOutput` to rank 0 (which passes it on to the
other ranks) and receives one reply per step, in order. `execute_model` returns a future;
resolving it reads replies FIFO while watching every local worker process, so a
worker that dies or raises surfaces as an error within moments, never as a hang. A step that
has run `watchdog_timeout` seconds without a reply (counted from when it was sent, or from the
previous step's reply if that came later: steps run in order) means a stopped or stuck worker
or a hung collective: the workers are killed and `WorkerError` makes the engine core die.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import wait

from vserve.config import EngineConfig
from vserve.core.sched_output import RunnerOutput, SchedulerOutput
from vserve.distributed.grid import local_ranks
from vserve.executor.base import Executor, StepFuture
from vserve.host.placement import layer_shares
from vserve.host.placement_control import PlacementController, overrides_from_env
from vserve.workers import messages as wire
from vserve.workers.runner_config import RunnerConfig
from vserve.workers.worker_proc import RankSetup, worker_main

logger = logging.getLogger("vserve.executor")

# libgomp (torch's OpenMP runtime) lets an idle pool thread spin for GOMP_SPINCOUNT iterations
# after each parallel region before it sleeps. 10k spins (set here before) let threads fall
# asleep inside a step, between one op's region and the next: measured on two cores, the async
# forward took 12-18% longer at batch 32 (tiny model, 262k vocabulary) and the batch-1 steps
# were no faster (embedded model) or slower (tiny). libgomp's own 300k is pinned here so a
# runtime with another default does not change it; a value the user sets wins. Between two
# steps a worker that shares its cores with the host work parks the team instead, so that
# the spin does not hold a core the engine core needs then (workers/host_gap.py).
WORKER_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "300000"}


class WorkerError(RuntimeError):
    """A worker raised or died; the message says which and why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        par = config.parallel
        if par.node_rank != 0:
            raise ValueError("the engine runs on node 0; start other nodes with `vserve worker`")
        self._closing = False
        self.replies: dict[int, RunnerOutput] = {}
        self.watchdog_timeout = config.watchdog_timeout
        self._sent_at: dict[int, float] = {}  # step id -> when it was sent (monotonic)
        self._last_reply_at = 0.0  # steps run in order: none starts before this
        port = par.master_port or free_port()
        ctx = mp.get_context("spawn")
        req_r, self.req_w = ctx.Pipe(duplex=False)
        self.resp_r, resp_w = ctx.Pipe(duplex=False)
        ranks = local_ranks(par.world_size, par.nnodes, 0)
        tp = par.tensor_parallel_size
        self.placement = PlacementController(
            len(ranks),
            overrides_from_env(),
            lambda p: self._send(wire.Place(_per_rank(p, ranks))),
            measure_self=config.async_scheduling,
            layer_shares=layer_shares(par.layer_partition, [r // tp for r in ranks]),
            pin_workers=tp > 1,
        )
        initial = self.placement.placement
        self.procs = []
        for i, rank in enumerate(ranks):
            setup = RankSetup(
                rank,
                par.world_size,
                par.master_addr,
                port,
                initial.worker_threads[i],
                initial.worker_cpus[i],
                initial.prefill_threads_of(i),
            )
            conns = (req_r, resp_w) if rank == 0 else (None, None)
            proc = ctx.Process(
                target=worker_main,
                args=(RunnerConfig.of(config, rank // tp, rank % tp), setup, *conns),
                name=f"vserve-worker-{rank}",
                daemon=True,
            )
            with _environment(WORKER_ENV_DEFAULTS):  # read by the child's runtime at start
                proc.start()
            self.procs.append(proc)
        req_r.close()
        resp_w.close()
        self.placement.worker_pids = [p.pid for p in self.procs]
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="vserve-watch")
        self._monitor.start()
        self._call(wire.Load())
        self.placement.start()

    # -- Executor ----------------------------------------------------------------------------------
    def num_kv_blocks(self) -> int:
        return self._call(wire.NumKvBlocks())

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call(wire.InitKvCache(num_blocks))

    def execute_model(self, so: SchedulerOutput, defer_sampling: bool = False) -> StepFuture | None:
        self._send(wire.Execute(so, defer_sampling))
        self._sent_at[so.step_id] = time.monotonic()
        return None if defer_sampling else self._future(so.step_id)

    def sample_tokens(self, so: SchedulerOutput) -> StepFuture:
        self._send(wire.Sample(so.step_id, so.grammar_bitmask))
        self._sent_at[so.step_id] = time.monotonic()
        return self._future(so.step_id)

    def _future(self, step_id: int) -> StepFuture:
        return StepFuture(lambda timeout: self._reply_for(step_id, timeout))

    def worker_memory(self) -> dict[str, int]:
        from vserve.startup import resident_bytes

        return {f"worker_{rank}": resident_bytes(p.pid) for rank, p in enumerate(self.procs)}

    def add_host_process(self, pid: int) -> None:
        """The front end's process: pinned with the engine core, its CPU time is host work."""
        self.placement.add_host_process(pid)

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise WorkerError(
                    f"worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"
                )

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.placement.release()
        try:
            self._send(wire.Shutdown())
        except (OSError, ValueError):
            pass
        for proc in self.procs:
            proc.join(timeout=5)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.req_w.close()
        self.resp_r.close()

    def kill(self) -> None:
        """Stop every worker now (SIGKILL also ends a stopped or stuck one)."""
        self._closing = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)

    # -- internals ---------------------------------------------------------------------------------
    def _send(self, msg: wire.WorkerRequest) -> None:
        self.req_w.send_bytes(wire.encode(msg))

    def _call(self, msg: wire.WorkerRequest, timeout: float | None = None):
        self._send(msg)
        reply = self._recv(timeout)
        if not isinstance(reply, wire.Ok):
            raise WorkerError(
                f"the workers answered {type(reply).__name__} to {type(msg).__name__}"
            )
        return reply.value

    def _reply_for(self, step_id: int, timeout: float | None) -> RunnerOutput:
        while step_id not in self.replies:
            try:
                reply = self._recv(self._wait_limit(step_id, timeout))
            except TimeoutError:
                self._check_deadline(step_id)
                raise
            if not isinstance(reply, wire.Out):
                raise WorkerError(f"the workers answered {type(reply).__name__} to a step")
            value = reply.output
            self.replies[value.step_id] = value
            self._last_reply_at = time.monotonic()
            if value.timing is not None:
                self.placement.step_done(value.timing.forward_end - value.timing.recv)
        self._sent_at.pop(step_id, None)
        return self.replies.pop(step_id)

    def _running_since(self, step_id: int) -> float | None:
        """When the workers may have started this step (it was sent, and the step before it
        replied); None when the watchdog is off."""
        if not self.watchdog_timeout or step_id not in self._sent_at:
            return None
        return max(self._sent_at[step_id], self._last_reply_at)

    def _wait_limit(self, step_id: int, timeout: float | None) -> float | None:
        since = self._running_since(step_id)
        if since is None:
            return timeout
        left = max(0.0, since + self.watchdog_timeout - time.monotonic())
        return left if timeout is None else min(timeout, left)

    def _check_deadline(self, step_id: int) -> None:
        """The watchdog: a step running for `watchdog_timeout` means a hung worker."""
        since = self._running_since(step_id)
        if since is None:
            return
        waited = time.monotonic() - since
        if waited >= self.watchdog_timeout:
            self.kill()
            raise WorkerError(
                f"watchdog: step {step_id} got no reply from the workers in "
                f"{waited:.1f} s (watchdog_timeout={self.watchdog_timeout:g} s); "
                "the workers were killed"
            )

    def _recv(self, timeout: float | None) -> wire.WorkerReply:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs)}
        ready = wait([self.resp_r, *sentinels], timeout)
        if self.resp_r in ready:
            try:
                data = self.resp_r.recv_bytes()
            except (EOFError, OSError):
                self.check_health()
                raise WorkerError("the workers closed their reply channel") from None
            try:
                reply = wire.decode_reply(data)  # typed: the last rank may be on another host
            except wire.MessageError as e:
                raise WorkerError(str(e)) from None
            if isinstance(reply, wire.Error):
                raise WorkerError(reply.message)
            return reply
        if not ready:
            raise TimeoutError("no reply from the workers")
        rank, proc = sentinels[ready[0]]
        proc.join(timeout=1)
        raise WorkerError(
            f"worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"
        )

    def _watch(self) -> None:
        wait([p.sentinel for p in self.procs])
        if not self._closing and self.on_failure is not None:
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
            self.on_failure(f"worker process died: rank/exit code {dead}")


def _per_rank(placement, ranks: range) -> dict[int, tuple[int, int, tuple[int, ...]]]:
    """What each local rank needs of a placement: {rank: (torch threads, prefill threads,
    CPUs)}."""
    return {
        rank: (
            placement.worker_threads[i],
            placement.prefill_threads_of(i),
            placement.worker_cpus[i],
        )
        for i, rank in enumerate(ranks)
    }


@contextmanager
def _environment(defaults: dict[str, str]):
    """`defaults` in os.environ (where unset) for the duration: a spawned child inherits them."""
    added = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
