"""Clients for an engine core in its own process: `SyncMPClient` (used by `LLM`) and
`AsyncMPClient` (used by the HTTP server through `AsyncLLM`).

The front end binds two ZMQ sockets on `ipc://` paths inside a private temporary directory
(mode 0700), spawns `EngineCoreProc`, and waits for its READY frame (with a timeout, watching
the process). A monitor thread watches the process sentinel: if the engine core dies, every
pending call gets `EngineDeadError` within moments.

The watchdog (`watchdog_timeout` > 0) pings the engine core; the busy loop answers between
steps. A ping unanswered for `watchdog_timeout` + `WATCHDOG_GRACE_S` seconds (a stuck main
loop, a dead input or output thread, a stopped process) kills the engine core's process group
(the core and its workers) and fails every pending call. The core's own step deadline
(`MultiprocExecutor`) normally fires first, with a more precise message.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from vserve.config import EngineConfig
from vserve.cpu_affinity import pin_process, process_cpus
from vserve.engine.core_proc import FRAME_DEAD, FRAME_OUTPUTS, FRAME_READY
from vserve.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    pack_requests,
)
from vserve.envs import ENV

logger = logging.getLogger("vserve")
READY_TIMEOUT_S = ENV.engine_ready_timeout
WATCHDOG_GRACE_S = 2.0  # lets the engine core's own step deadline report first
SEND_RETRY_S = 0.002  # a send finds no engine socket connected (start-up, or it is gone)
PING_WAIT_S = 1.0  # the watchdog looks at its ping at least this often


def watchdog_periods(timeout: float) -> tuple[float, float]:
    """(seconds between pings, seconds a ping may wait) for a `watchdog_timeout`."""
    return min(max(timeout / 4, 0.2), 30.0), timeout + WATCHDOG_GRACE_S


class EngineDeadError(RuntimeError):
    """The engine core is gone; `outputs` holds what every pending request ended with."""

    def __init__(self, message: str, outputs=None) -> None:
        super().__init__(message)
        self.outputs = outputs or []


class _EngineProcess:
    """Starts the engine core, owns the socket paths, does the handshake and cleans up.

    The core starts as a fresh interpreter (`python -m vserve.engine.core_proc`) that reads its
    config from stdin: a spawn that never re-imports the user's script, so `LLM(...)` works in
    scripts without a `__main__` guard, in notebooks and under `python -c`."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context) -> None:
        self.name = _engine_name(config)
        self._cpus = process_cpus(os.getpid())  # the engine core may pin us beside it
        self.tmpdir = tempfile.mkdtemp(prefix="vserve-")
        os.chmod(self.tmpdir, 0o700)
        input_addr = f"ipc://{self.tmpdir}/input"
        output_addr = f"ipc://{self.tmpdir}/output"
        self.input_sock = ctx.socket(zmq.PUSH)
        self.input_sock.bind(input_addr)
        self.output_sock = ctx.socket(zmq.PULL)
        self.output_sock.bind(output_addr)
        self.proc = spawn_engine_core(config, input_addr, output_addr)
        self.stopping = threading.Event()  # set once we stop it: its exit is no error
        # stop the engine core when the client is collected or the interpreter exits
        self._finalizer = weakref.finalize(
            self, _stop_process, self.proc, self.tmpdir, self.stopping
        )
        self.info = self._handshake(ctx, output_addr)

    @property
    def closing(self) -> bool:
        return self.stopping.is_set()

    def _handshake(self, ctx, output_addr):
        # a plain socket for the handshake, so async clients need no running loop yet
        sock = self.output_sock
        if isinstance(sock, zmq.asyncio.Socket):
            raise AssertionError("handshake needs a sync socket")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if sock.poll(200):
                frame, payload = sock.recv_multipart()
                if frame == FRAME_READY:
                    return msgspec.msgpack.decode(payload)
                if frame == FRAME_DEAD:
                    self.close()
                    raise RuntimeError(payload.decode())
            if not self.alive():
                self.close()
                raise RuntimeError(
                    f"{self.name} exited during start-up (exit code "
                    f"{self.proc.returncode}); see the log above"
                )
        self.close()
        raise TimeoutError(f"{self.name} was not ready within {READY_TIMEOUT_S:.0f} s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_gone(self) -> str:
        """Block until the engine core is gone; returns what to report if that was no stop."""
        self.proc.wait()
        return f"{self.name} process died (exit code {self.exitcode})"

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the engine core and every process it started (a hang: nothing polite)."""
        _kill_group(self.proc)

    def close(self) -> None:
        self.stopping.set()
        if self.alive():
            try:
                self.input_sock.send_multipart(
                    [bytes([RequestType.SHUTDOWN]), b""], flags=zmq.NOBLOCK
                )
            except zmq.ZMQError:
                pass
            _wait(self.proc, 20)
        if self.alive():
            self.proc.terminate()
            _wait(self.proc, 5)
        if self.alive():
            _kill_group(self.proc)
            self.proc.wait()
        self.input_sock.close(linger=0)
        self.output_sock.close(linger=0)
        self._finalizer()
        self.restore_cpus()

    def restore_cpus(self) -> None:
        """Our CPUs as before the engine core pinned us beside it: it gives them back when it
        shuts down, but not when it dies (or is killed by the watchdog). Call once it is gone."""
        if self._cpus and process_cpus(os.getpid()) != self._cpus:
            pin_process(os.getpid(), self._cpus)


def spawn_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str
) -> subprocess.Popen[bytes]:
    """`python -m vserve.engine.core_proc` with the config on its stdin (a local pipe), in
    its own process group, which its workers join: one signal ends the whole tree."""
    level = logging.getLevelName(logging.getLogger("vserve").getEffectiveLevel())
    proc: subprocess.Popen[bytes] = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vserve.engine.core_proc",
            input_addr,
            output_addr,
            str(os.getpid()),
            level,
        ],
        stdin=subprocess.PIPE,
        **_NEW_GROUP,
    )
    share = cpu_share(config)
    if share:  # before the core starts any thread: they and its workers inherit it
        pin_process(proc.pid, share)
    stdin = proc.stdin
    assert stdin is not None  # stdin=PIPE
    stdin.write(pickle.dumps(config))
    stdin.close()
    return proc


def _engine_name(config: EngineConfig) -> str:
    dp = config.data_parallel
    return "the engine core" if dp.size == 1 else f"data-parallel engine {dp.engine_index}"


def cpu_share(config: EngineConfig) -> tuple[int, ...]:
    """The CPUs of one of several engines on this host: the host's CPUs in equal parts, one
    per local engine (none when there are fewer CPUs than engines: the OS shares them)."""
    dp = config.data_parallel
    cpus = process_cpus(os.getpid())
    if dp.size_local <= 1 or len(cpus) < dp.size_local:
        return ()
    part = len(cpus) // dp.size_local
    index = dp.engine_index - dp.start_rank
    return cpus[index * part : (index + 1) * part]


def _stop_process(proc: subprocess.Popen, tmpdir: str, stopping: threading.Event) -> None:
    stopping.set()
    if proc.poll() is None:
        proc.terminate()
        _wait(proc, 10)
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    shutil.rmtree(tmpdir, ignore_errors=True)


# Python 3.11 names it; before, a new session does the same for a non-interactive child
_NEW_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group led by `proc` (its workers included). A group id stays
    reserved while any member lives, so this never reaches a stranger's group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.kill()


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


EngineFactory = Callable[[zmq.Context], Any]  # a context -> an engine like `_EngineProcess`


class _ClientBase(abc.ABC):
    engine: _EngineProcess
    watchdog_timeout: float
    engine_index: int = 0  # the engine's data-parallel rank, stamped on what it sends

    def _init_common(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._out_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._call_ids = itertools.count()
        self.dead_message: str | None = None

    def _frames_add(self, requests: list[EngineCoreRequest]):
        return [bytes([RequestType.ADD]), self._encoder.encode(pack_requests(requests))]

    def _frames_abort(self, request_ids: list[str]):
        return [bytes([RequestType.ABORT]), self._encoder.encode(list(request_ids))]

    def _frames_utility(self, call_id: int, method: str, args):
        return [bytes([RequestType.UTILITY]), self._encoder.encode([call_id, method, list(args)])]

    def _decode(self, frames) -> EngineCoreOutputs:
        frame, payload = frames
        if frame == FRAME_OUTPUTS:
            outs = self._out_decoder.decode(payload)
            outs.engine_index = self.engine_index
            return outs
        if frame == FRAME_DEAD:
            return self._error(payload.decode())
        raise RuntimeError(f"unexpected frame {frame!r} from the engine core")

    def _error(self, message: str) -> EngineCoreOutputs:
        return EngineCoreOutputs(engine_error=message, engine_index=self.engine_index)

    @abc.abstractmethod
    def _route(self, outs: EngineCoreOutputs) -> None:
        """Hand one decoded message to its waiter (the engine's outputs or a utility call)."""

    @abc.abstractmethod
    def _die(self, message: str) -> None:
        """Mark the engine dead: every pending call and output wait gets `message`."""

    def _watchdog_fired(self, waited: float) -> None:
        if self.engine.closing or self.dead_message is not None:
            return
        self._die(
            f"watchdog: {self.engine.name} did not answer for {waited:g} s "
            f"(watchdog_timeout={self.watchdog_timeout:g} s); it and its workers were "
            "killed"
        )
        self.engine.kill()

    def _route_frames(self, frames) -> bool:
        """Decode and route one message; an unexpected error marks the engine dead (a reader
        that stopped silently would hang every request). Returns False when reading ends."""
        try:
            self._route(self._decode(frames))
            return True
        except Exception as e:  # noqa: BLE001 -- see above
            logger.exception("the engine client's reader failed")
            self._die(f"the engine client's reader failed: {type(e).__name__}: {e}")
            return False

    @staticmethod
    def _utility_value(outs: EngineCoreOutputs):
        assert outs.utility_result is not None  # the engine core answers every call with one
        result = msgspec.msgpack.decode(outs.utility_result)
        if "error" in result:
            raise ValueError(result["error"])
        return result["ok"]


class SyncMPClient(_ClientBase):
    """`outputs`: where the engine's outputs go (data parallel shares one queue among its
    engines); `engine`: how to start or reach the engine core (default: a local process)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        outputs: queue.Queue[EngineCoreOutputs] | None = None,
        engine: EngineFactory | None = None,
    ) -> None:
        self._init_common()
        self.engine_index = config.data_parallel.engine_index
        self.ctx = zmq.Context()
        self.outputs: queue.Queue[EngineCoreOutputs] = outputs or queue.Queue()
        try:
            self.engine = (engine or (lambda ctx: _EngineProcess(config, ctx)))(self.ctx)
        except BaseException:
            self.ctx.term()
            raise
        self.num_kv_blocks = self.engine.info["num_kv_blocks"]
        self._utility: dict[int, queue.Queue] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(
            target=self._read_loop, daemon=True, name="vserve-client-reader"
        )
        self._reader.start()
        self._monitor = threading.Thread(
            target=self._watch, daemon=True, name="vserve-client-monitor"
        )
        self._monitor.start()
        self.watchdog_timeout = config.watchdog_timeout
        if self.watchdog_timeout:
            threading.Thread(
                target=self._ping_loop, daemon=True, name="vserve-client-watchdog"
            ).start()

    def _ping_loop(self) -> None:
        interval, limit = watchdog_periods(self.watchdog_timeout)
        while not self.engine.stopping.wait(interval) and self.dead_message is None:
            try:
                self.call_utility("ping", timeout=limit)
            except queue.Empty:
                self._watchdog_fired(limit)
                return
            except (EngineDeadError, zmq.ZMQError):  # dead, or shut down meanwhile
                return

    def _read_loop(self) -> None:
        sock = self.engine.output_sock
        while not self.engine.closing:
            try:
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return
            if not self._route_frames(frames):
                return

    def _route(self, outs: EngineCoreOutputs) -> None:
        if outs.engine_error:
            self._die(outs.engine_error)
        elif outs.utility_call_id >= 0:
            waiter = self._utility.pop(outs.utility_call_id, None)
            if waiter is not None:
                waiter.put(outs)
        else:
            self.outputs.put(outs)

    def _watch(self) -> None:
        message = self.engine.wait_gone()
        self.engine.restore_cpus()
        if not self.engine.closing:
            time.sleep(0.2)  # let a DEAD frame that is on its way win
            self._die(message)

    def _die(self, message: str) -> None:
        if self.dead_message is None:
            self.dead_message = message
            logger.error("engine core dead: %s", message)
        self.outputs.put(self._error(message))
        for waiter in list(self._utility.values()):
            waiter.put(self._error(message))

    def _send(self, frames) -> None:
        with self._send_lock:
            while True:  # a PUSH without a peer (the engine gone) would block for ever
                if self.dead_message is not None:
                    raise EngineDeadError(self.dead_message)
                try:
                    self.engine.input_sock.send_multipart(frames, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    time.sleep(SEND_RETRY_S)

    # -- client API --------------------------------------------------------------------------------
    def add_requests(
        self, requests: list[EngineCoreRequest], data_parallel_rank: int | None = None
    ) -> int:
        """Returns the engine's data-parallel rank (the one engine there is)."""
        _check_rank(data_parallel_rank, self.engine_index)
        self._send(self._frames_add(requests))
        return self.engine_index

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_message is None:
            self._send(self._frames_abort(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        return self.outputs.get()

    def call_utility(self, method: str, *args, timeout: float = 60.0):
        call_id = next(self._call_ids)
        waiter: queue.Queue = queue.Queue()
        self._utility[call_id] = waiter
        try:
            self._send(self._frames_utility(call_id, method, args))
            outs = waiter.get(timeout=timeout)
        finally:
            self._utility.pop(call_id, None)
        if outs.engine_error:
            raise EngineDeadError(outs.engine_error)
        return self._utility_value(outs)

    def process_memory(self) -> dict[str, int]:
        return self.call_utility("process_memory")

    def shutdown(self) -> None:
        if not self.engine.closing:
            self.engine.close()
            self._reader.join(timeout=2)
            for waiter in list(self._utility.values()):  # a ping in flight, for one
                waiter.put(EngineCoreOutputs(engine_error="the engine was shut down"))
            self.ctx.term()


class AsyncMPClient(_ClientBase):
    """The same engine core, driven from an asyncio loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        outputs: asyncio.Queue[EngineCoreOutputs] | None = None,
        engine: EngineFactory | None = None,
    ) -> None:
        self._init_common()
        self.engine_index = config.data_parallel.engine_index
        sync_ctx = zmq.Context()
        try:
            self.engine = (engine or (lambda ctx: _EngineProcess(config, ctx)))(sync_ctx)
        except BaseException:
            sync_ctx.term()
            raise
        self.num_kv_blocks = self.engine.info["num_kv_blocks"]
        self._sync_ctx = sync_ctx
        self._in = zmq.asyncio.Socket.from_socket(self.engine.input_sock)
        self._out = zmq.asyncio.Socket.from_socket(self.engine.output_sock)
        self._utility: dict[int, asyncio.Future] = {}
        # made by start(), on the running loop, unless shared (data parallel)
        self.outputs: asyncio.Queue[EngineCoreOutputs] | None = outputs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._ping_task: asyncio.Task[None] | None = None
        self._monitor: threading.Thread | None = None
        self.watchdog_timeout = config.watchdog_timeout

    def start(self) -> None:
        """Bind to the running loop (call from inside it)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.outputs is None:
            self.outputs = asyncio.Queue()
        self._reader_task = self._loop.create_task(self._read_loop())
        if self.watchdog_timeout:
            self._ping_task = self._loop.create_task(self._ping_loop())
        self._monitor = threading.Thread(
            target=self._watch, daemon=True, name="vserve-async-monitor"
        )
        self._monitor.start()

    async def _ping_loop(self) -> None:
        interval, limit = watchdog_periods(self.watchdog_timeout)
        while not self.engine.closing and self.dead_message is None:
            await asyncio.sleep(interval)
            try:
                answered = await self._ping(limit)
            except EngineDeadError:
                return
            if not answered:
                self._watchdog_fired(limit)
                return

    async def _ping(self, limit: float) -> bool:
        """Whether the engine core answers a ping within `limit` seconds of its own time.
        A wait at whose end the engine's reply (or any frame of it) sits unread in our
        socket does not count: then this loop was busy elsewhere, not the engine (a stall
        of the event loop must never get a live engine killed)."""
        assert self._loop is not None, "start() first"
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._utility[call_id] = fut
        waited = 0.0
        try:
            await self._send(self._frames_utility(call_id, "ping", []))
            while waited < limit:
                started = self._loop.time()
                await asyncio.wait({fut}, timeout=min(PING_WAIT_S, limit - waited))
                if fut.done():
                    outs = fut.result()
                    if outs.engine_error:
                        raise EngineDeadError(outs.engine_error)
                    return True
                if not self._frames_waiting():
                    waited += self._loop.time() - started
            return False
        finally:
            self._utility.pop(call_id, None)

    def _frames_waiting(self) -> bool:
        try:
            return bool(int(self._out.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    async def _read_loop(self) -> None:
        while not self.engine.closing:
            try:
                frames = await self._out.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if not self._route_frames(frames):
                return

    def _route(self, outs: EngineCoreOutputs) -> None:
        if outs.engine_error:
            self._die(outs.engine_error)
        elif outs.utility_call_id >= 0:
            fut = self._utility.pop(outs.utility_call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(outs)
        else:
            assert self.outputs is not None  # read only after start()
            self.outputs.put_nowait(outs)

    def _watch(self) -> None:
        message = self.engine.wait_gone()
        self.engine.restore_cpus()
        if not self.engine.closing:
            time.sleep(0.2)
            assert self._loop is not None  # watched only after start()
            self._loop.call_soon_threadsafe(self._die, message)

    def _die(self, message: str) -> None:
        if self.dead_message is None:
            self.dead_message = message
            logger.error("engine core dead: %s", message)
            assert self.outputs is not None  # its callers run after start()
            self.outputs.put_nowait(self._error(message))
            for fut in self._utility.values():
                if not fut.done():
                    fut.set_result(self._error(message))

    async def _send(self, frames) -> None:
        while True:  # a PUSH without a peer (the engine gone) would wait for ever
            if self.dead_message is not None:
                raise EngineDeadError(self.dead_message)
            try:
                await self._in.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                await asyncio.sleep(SEND_RETRY_S)

    # -- client API --------------------------------------------------------------------------------
    async def add_requests_async(
        self, requests: list[EngineCoreRequest], data_parallel_rank: int | None = None
    ) -> int:
        """Returns the engine's data-parallel rank (the one engine there is)."""
        _check_rank(data_parallel_rank, self.engine_index)
        await self._send(self._frames_add(requests))
        return self.engine_index

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_message is None:
            await self._send(self._frames_abort(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        assert self.outputs is not None, "start() first"
        return await self.outputs.get()

    async def call_utility_async(self, method: str, *args, timeout: float = 60.0):
        call_id = next(self._call_ids)
        assert self._loop is not None, "start() first"
        fut = self._loop.create_future()
        self._utility[call_id] = fut
        try:
            await self._send(self._frames_utility(call_id, method, args))
            outs = await asyncio.wait_for(fut, timeout)
        finally:
            self._utility.pop(call_id, None)
        if outs.engine_error:
            raise EngineDeadError(outs.engine_error)
        return self._utility_value(outs)

    def stop_tasks(self) -> None:
        """Cancel this client's tasks (on the loop's thread: before a shutdown elsewhere)."""
        for task in (self._reader_task, self._ping_task):
            if task is not None:
                task.cancel()
        self._reader_task = self._ping_task = None

    def shutdown(self) -> None:
        if not self.engine.closing:
            self.engine.stopping.set()
            self.stop_tasks()
            self.engine.close()
            self._sync_ctx.term()


def _check_rank(wanted: int | None, rank: int) -> None:
    if wanted is not None and wanted != rank:
        raise ValueError(f"data_parallel_rank {wanted}: this server runs engine rank {rank} only")
