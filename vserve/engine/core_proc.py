"""`EngineCoreProc`: the engine core in its own process, with an input thread, the busy loop
and an output thread.

Front end -> core: ZMQ PUSH/PULL over `ipc://` in a private temporary directory; frames are
`[type byte, msgpack payload]` decoded with msgspec into typed structs -- nothing from the front
end is unpickled. Core -> front end: READY once (after the handshake), then OUTPUTS; DEAD with a
message if the core fails, so every pending request gets an error instead of a hang.

The busy loop blocks on the input queue while there is no work. Aborts go to the engine at
once (applied before the next commit) and also through the ordered input queue, so an abort
never overtakes the ADD it cancels; an eager abort carries the number of ADDs seen before it,
so it never finishes a later request that reuses the id.

Isolation: a frame that fails to decode, or an ADD for an id that is still live, becomes an
error output for that request; a frame whose request cannot be told, or any unexpected error
in the I/O threads, is fatal and reported (DEAD), never a silently stopped thread. A lifeline
thread (`vserve.host.lifeline`) exits the process, workers included, when the front end is gone,
whatever the other threads are doing.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from vserve.config import EngineConfig
from vserve.engine.core import EngineCore
from vserve.engine.dp.transport import secure_client, watch_disconnect
from vserve.engine.messages import (
    FRAME_DEAD,
    FRAME_OUTPUTS,
    FRAME_READY,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequests,
    RequestType,
    unpack_requests,
)
from vserve.envs import read_env
from vserve.host.lifeline import exit_with_parent
from vserve.host.policy import HostPolicy

logger = logging.getLogger("vserve.engine")


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, log_level: str
) -> None:
    """Process entry point (spawn)."""
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    os.environ.setdefault("VSERVE_LOG_LEVEL", log_level)  # workers log at the same level
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started: list[EngineCoreProc] = []  # the front end may die while we start or are stuck

    def shut_down_started() -> None:
        for p in started:
            p.request_shutdown()

    exit_with_parent(parent_pid, shut_down_started, grace_s=5.0)
    proc = EngineCoreProc(config, input_addr, output_addr, parent_pid)
    started.append(proc)
    signal.signal(signal.SIGTERM, lambda *_: proc.request_shutdown())
    os._exit(proc.run())


class LocalInput(enum.Enum):
    """Inputs of the busy loop that come from this process, never from the wire."""

    WAKE = "wake"  # a grammar finished compiling
    FATAL = "fatal"  # a thread or a worker failed: the engine core dies with this message


class EngineCoreProc:
    def __init__(
        self, config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int
    ) -> None:
        self.ctx = zmq.Context()
        # a remote (headless) engine reaches the head over TCP: encrypted with the shared
        # secret, and it stops when the head's connection drops
        self.remote = output_addr.startswith("tcp://")
        self.secret = read_env().dp_secret if self.remote else None
        self.out_sock = self.ctx.socket(zmq.PUSH)
        self.out_sock.setsockopt(zmq.LINGER, 5000)
        secure_client(self.out_sock, self.secret)
        if self.remote:
            watch_disconnect(self.out_sock, self.request_shutdown, "vserve-head-watch")
        self.out_sock.connect(output_addr)
        # (kind, payload): the wire's kinds, and two of this process's own
        self.input_queue: queue.Queue[tuple[RequestType | LocalInput, Any]] = queue.Queue()
        # what the output thread sends, in order; None ends it
        self.output_queue: queue.Queue[EngineCoreOutputs | None] = queue.Queue()
        self._stop = threading.Event()
        self.encoder = msgspec.msgpack.Encoder()
        try:
            self.core = EngineCore(config)
        except BaseException as e:
            self._send_now(FRAME_DEAD, _error_text("engine core failed to start", e).encode())
            raise
        # a finished compile wakes the busy loop (it blocks while only compiles wait)
        self.core.structured.on_compiled = lambda: self.input_queue.put((LocalInput.WAKE, None))
        executor = self.core.executor
        executor.on_failure = lambda msg: self.input_queue.put((LocalInput.FATAL, msg))
        HostPolicy.of(config, remote=self.remote).apply_to_engine_core(executor, parent_pid)
        self._send_now(
            FRAME_READY,
            self.encoder.encode({"num_kv_blocks": self.core.num_kv_blocks, "pid": os.getpid()}),
        )
        self.num_adds = 0  # ADD frames seen by the input thread (orders eager aborts)
        self.in_thread = threading.Thread(
            target=self._input_loop, args=(input_addr,), daemon=True, name="vserve-input"
        )
        self.out_thread = threading.Thread(
            target=self._output_loop, daemon=True, name="vserve-output"
        )
        self.in_thread.start()
        self.out_thread.start()

    def request_shutdown(self) -> None:
        self.input_queue.put((RequestType.SHUTDOWN, None))

    # -- busy loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        code = 0
        was_busy = False
        try:
            while True:
                # block while idle, and while only grammar compiles wait (a step would be
                # empty): a new input or a finished compile (a "wake" input) ends the wait
                idle = not self.core.has_work() or self.core.waiting_for_grammars()
                if not self._process_inputs(block=idle):
                    break
                if self.core.waiting_for_grammars():
                    continue
                outputs = self.core.step_fn()
                busy = self.core.has_work()
                if outputs is not None or (was_busy and not busy):
                    # publish stats on every commit and once more when going idle
                    self.output_queue.put(
                        EngineCoreOutputs(outputs or [], self.core.make_stats(), time.time())
                    )
                was_busy = busy
        except BaseException as e:
            code = 1
            logger.error("engine core failed:\n%s", traceback.format_exc())
            self.output_queue.put(
                EngineCoreOutputs(engine_error=_error_text("engine core failed", e))
            )
        finally:
            self._stop.set()
            self.output_queue.put(None)
            self.out_thread.join(timeout=10)
            self.in_thread.join(timeout=2)
            self.core.shutdown()
            self.out_sock.close()
            self.ctx.term()
        return code

    def _process_inputs(self, block: bool) -> bool:
        """Apply queued inputs; returns False on shutdown."""
        while True:
            try:
                kind, payload = self.input_queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == LocalInput.WAKE:
                pass
            elif kind == RequestType.ADD:
                self._add_request(*payload)
            elif kind == RequestType.ABORT:
                self.core.abort_now(payload)
            elif kind == RequestType.UTILITY:
                self._run_utility(*payload)
            elif kind == LocalInput.FATAL:
                raise RuntimeError(payload)
            elif kind == RequestType.SHUTDOWN:
                return False

    def _add_request(self, seq: int, request: EngineCoreRequest) -> None:
        """Admit a request; one that cannot be admitted (its id is still live) gets an error
        output of its own and the engine carries on."""
        request_id = request.request_id
        if self.core.has_request(request_id):
            self._fail_request(
                request_id, f"request id {request_id!r} is already running", request.incarnation
            )
            return
        try:
            self.core.add_request(request, seq)
        except Exception as e:  # noqa: BLE001 -- belongs to this request only
            logger.exception("request %s could not be added", request_id)
            self._fail_request(
                request_id, f"the engine could not add the request: {e}", request.incarnation
            )

    def _fail_request(self, request_id: str, message: str, incarnation: int = 0) -> None:
        out = EngineCoreOutput(
            request_id, [], finish_reason="error", error=message, incarnation=incarnation
        )
        self.output_queue.put(EngineCoreOutputs([out], None, time.time()))

    def _run_utility(self, call_id: int, method: str, args: list) -> None:
        try:
            payload = self.encoder.encode({"ok": self.core.call_utility(method, *args)})
        except Exception as e:  # reported to the caller, not fatal
            payload = self.encoder.encode({"error": str(e)})
        self.output_queue.put(EngineCoreOutputs([], None, time.time(), call_id, payload))

    # -- IO threads --------------------------------------------------------------------------------
    def _input_loop(self, input_addr: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        secure_client(sock, self.secret)
        sock.connect(input_addr)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequests)
        decoder = msgspec.msgpack.Decoder()
        try:
            while not self._stop.is_set():
                if sock.poll(200):
                    self._on_frames(sock.recv_multipart(), add_decoder, decoder)
        except Exception as e:  # noqa: BLE001 -- a dead input thread would hang every request
            self._fatal("engine input thread failed", e)
        finally:
            sock.close(linger=0)

    def _on_frames(self, frames: list[bytes], add_decoder, decoder) -> None:
        """One message: a bad ADD fails its request; any other bad frame is fatal."""
        try:
            kind, payload = frames
            self._dispatch(RequestType(kind[0]), payload, add_decoder, decoder)
        except Exception as e:  # noqa: BLE001
            request_ids = _add_request_ids(frames, decoder)
            if not request_ids:
                self._fatal("engine core got a frame it cannot decode", e)
                return
            logger.error("request(s) %s: frame does not decode: %s", request_ids, e)
            for request_id in request_ids:
                self._fail_request(request_id, f"the engine could not decode the request: {e}")

    def _dispatch(self, kind: RequestType, payload: bytes, add_decoder, decoder) -> None:
        if kind == RequestType.ADD:
            requests = unpack_requests(add_decoder.decode(payload))
            self.num_adds += 1
            for request in requests:
                self.input_queue.put((RequestType.ADD, (self.num_adds, request)))
        elif kind == RequestType.ABORT:
            ids = decoder.decode(payload)
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError(f"an abort needs a list of request ids, got {ids!r:.80}")
            self.core.abort_requests(ids, self.num_adds)  # before the next commit
            self.input_queue.put((RequestType.ABORT, ids))  # in order with the ADDs
        elif kind == RequestType.UTILITY:
            call_id, method, args = decoder.decode(payload)
            self.input_queue.put((RequestType.UTILITY, (call_id, method, args)))
        elif kind == RequestType.SHUTDOWN:
            self.request_shutdown()

    def _fatal(self, prefix: str, e: BaseException) -> None:
        """Ends the busy loop, which reports DEAD to the front end and shuts down."""
        logger.error("%s:\n%s", prefix, traceback.format_exc())
        self.input_queue.put((LocalInput.FATAL, _error_text(prefix, e)))

    def _output_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            item = self.output_queue.get()
            if item is None:
                return
            try:
                if item.engine_error is not None:
                    self.out_sock.send_multipart([FRAME_DEAD, item.engine_error.encode()])
                else:
                    self.out_sock.send_multipart([FRAME_OUTPUTS, encoder.encode(item)])
            except Exception as e:  # noqa: BLE001 -- keep running to send the DEAD frame
                self._fatal("engine output thread failed", e)

    def _send_now(self, frame: bytes, payload: bytes) -> None:
        self.out_sock.send_multipart([frame, payload])


def _add_request_ids(frames: list[bytes], decoder) -> list[str]:
    """The request ids of an ADD frame that failed to decode, as far as they can be read."""
    try:
        kind, payload = frames
        if kind[:1] != bytes([RequestType.ADD]):
            return []
        fields = decoder.decode(payload)  # EngineCoreRequests and its requests: array-like
        requests = fields[0] if isinstance(fields, list) and fields else []
        return [r[0] for r in requests if isinstance(r, list) and r and isinstance(r[0], str)]
    except Exception:  # noqa: BLE001 -- nothing to recover
        return []


def _error_text(prefix: str, e: BaseException) -> str:
    return f"{prefix}: {type(e).__name__}: {e}"


def main() -> None:
    import pickle
    import sys

    input_addr, output_addr, parent_pid, level = sys.argv[1:5]
    config = pickle.loads(sys.stdin.buffer.read())
    run_engine_core(config, input_addr, output_addr, int(parent_pid), level)


if __name__ == "__main__":
    main()
