"""Clients for an engine core in its own process: `SyncMPClient` (used by `LLM`) and
`AsyncMPClient` (used by the HTTP server through `AsyncLLM`).

The process itself (its start, the READY handshake, its stop) is `core_launcher.py`'s. A
monitor thread watches the process sentinel: if the engine core dies, every pending call gets
`EngineDeadError` within moments.

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
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from vserve.config import EngineConfig
from vserve.engine.core_launcher import EngineProcess
from vserve.engine.messages import (
    FRAME_DEAD,
    FRAME_OUTPUTS,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    pack_requests,
)

logger = logging.getLogger("vserve")
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


EngineFactory = Callable[[zmq.Context], Any]  # a context -> an engine like `EngineProcess`


class _ClientBase(abc.ABC):
    engine: EngineProcess
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
            self.engine = (engine or (lambda ctx: EngineProcess(config, ctx)))(self.ctx)
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
            self.engine = (engine or (lambda ctx: EngineProcess(config, ctx)))(sync_ctx)
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
        """Whether the engine core answers a ping within `limit` seconds of waiting. Each
        look at the reply counts at most `PING_WAIT_S`, however late the loop woke for it: a
        loop held up elsewhere (by anything that blocked it) must never get a live engine
        killed, and once it runs again its reader takes the reply that waits in the socket.
        The reply future is never cancelled (a timed-out `wait_for` would, on Python 3.12,
        even with the reply already read)."""
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
                waited += min(self._loop.time() - started, PING_WAIT_S)
            return False
        finally:
            self._utility.pop(call_id, None)

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
