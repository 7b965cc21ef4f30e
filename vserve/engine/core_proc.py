"""`EngineCoreProc`: the engine core in its own process, with an input thread, the busy loop
and an output thread.

Front end -> core: ZMQ PUSH/PULL over `ipc://` in a private temporary directory; frames are
`[type byte, msgpack payload]` decoded with msgspec into typed structs -- nothing from the front
end is unpickled. Core -> front end: READY once (after the handshake), then OUTPUTS; DEAD with a
message if the core fails, so every pending request gets an error instead of a hang.

The busy loop blocks on the input queue while there is no work. Aborts go to the engine at
once (applied before the next commit) and also through the ordered input queue, so an abort
never overtakes the ADD it cancels.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
import traceback

import msgspec
import zmq

from vserve.config import EngineConfig
from vserve.core.request import RequestStatus
from vserve.engine.core import EngineCore
from vserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, RequestType

logger = logging.getLogger("vserve.engine")

FRAME_READY, FRAME_OUTPUTS, FRAME_DEAD = b"R", b"O", b"D"
UTILITY_METHODS = {"reset_prefix_cache", "take_step_records", "ping", "num_kv_blocks_info",
                   "stats"}


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: str) -> None:
    """Process entry point (spawn)."""
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = EngineCoreProc(config, input_addr, output_addr, parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: proc.request_shutdown())
    os._exit(proc.run())


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str,
                 parent_pid: int) -> None:
        self.ctx = zmq.Context()
        self.out_sock = self.ctx.socket(zmq.PUSH)
        self.out_sock.setsockopt(zmq.LINGER, 5000)
        self.out_sock.connect(output_addr)
        self.parent_pid = parent_pid
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.core: EngineCore | None = None
        self.encoder = msgspec.msgpack.Encoder()
        try:
            self.core = EngineCore(config)
        except BaseException as e:
            self._send_now(FRAME_DEAD, _error_text("engine core failed to start", e))
            raise
        executor = self.core.executor
        if hasattr(executor, "on_failure"):
            executor.on_failure = lambda msg: self.input_queue.put(("executor_failed", msg))
        if hasattr(executor, "add_host_process"):   # the front end works beside the forward
            executor.add_host_process(parent_pid)
        self._send_now(FRAME_READY, self.encoder.encode(
            {"num_kv_blocks": self.core.num_kv_blocks, "pid": os.getpid()}))
        self.in_thread = threading.Thread(target=self._input_loop, args=(input_addr,),
                                          daemon=True, name="vserve-input")
        self.out_thread = threading.Thread(target=self._output_loop, daemon=True,
                                           name="vserve-output")
        self.in_thread.start()
        self.out_thread.start()

    def request_shutdown(self) -> None:
        self.input_queue.put(("shutdown", None))

    # -- busy loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        code = 0
        was_busy = False
        try:
            while True:
                if not self._process_inputs(block=not self.core.has_work()):
                    break
                outputs = self.core.step_fn()
                busy = self.core.has_work()
                if outputs is not None or (was_busy and not busy):
                    # publish stats on every commit and once more when going idle
                    self.output_queue.put(EngineCoreOutputs(
                        outputs or [], self.core.make_stats(), time.time()))
                was_busy = busy
        except BaseException as e:
            code = 1
            logger.error("engine core failed:\n%s", traceback.format_exc())
            self.output_queue.put((FRAME_DEAD, _error_text("engine core failed", e)))
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
            if kind == "add":
                self.core.add_request(payload)
            elif kind == "abort":
                self.core.scheduler.finish_requests(payload, RequestStatus.FINISHED_ABORTED)
            elif kind == "utility":
                self._run_utility(*payload)
            elif kind == "executor_failed":
                raise RuntimeError(payload)
            elif kind == "shutdown":
                return False

    def _run_utility(self, call_id: int, method: str, args: list) -> None:
        try:
            if method not in UTILITY_METHODS:
                raise ValueError(f"unknown utility method {method!r}")
            result = getattr(self, "_util_" + method)(*args)
            payload = self.encoder.encode({"ok": result})
        except Exception as e:  # reported to the caller, not fatal
            payload = self.encoder.encode({"error": str(e)})
        self.output_queue.put(EngineCoreOutputs([], None, time.time(), call_id, payload))

    def _util_reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def _util_take_step_records(self) -> list:
        return [dataclasses.asdict(r) for r in self.core.recorder.take()]

    def _util_ping(self) -> str:
        return "pong"

    def _util_num_kv_blocks_info(self) -> int:
        return self.core.num_kv_blocks

    def _util_stats(self) -> dict:
        return msgspec.structs.asdict(self.core.make_stats())

    # -- IO threads --------------------------------------------------------------------------------
    def _input_loop(self, input_addr: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(input_addr)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        decoder = msgspec.msgpack.Decoder()
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    if os.getppid() != self.parent_pid:   # front end gone: do not linger
                        self.request_shutdown()
                        return
                    continue
                kind, payload = sock.recv_multipart()
                self._dispatch(RequestType(kind[0]), payload, add_decoder, decoder)
        finally:
            sock.close(linger=0)

    def _dispatch(self, kind: RequestType, payload: bytes, add_decoder, decoder) -> None:
        if kind == RequestType.ADD:
            self.input_queue.put(("add", add_decoder.decode(payload)))
        elif kind == RequestType.ABORT:
            ids = decoder.decode(payload)
            self.core.abort_requests(ids)            # before the next commit
            self.input_queue.put(("abort", ids))     # in order with the ADDs
        elif kind == RequestType.UTILITY:
            self.input_queue.put(("utility", tuple(decoder.decode(payload))))
        elif kind == RequestType.SHUTDOWN:
            self.request_shutdown()

    def _output_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            item = self.output_queue.get()
            if item is None:
                return
            if isinstance(item, tuple):
                self.out_sock.send_multipart([item[0], item[1]])
            else:
                self.out_sock.send_multipart([FRAME_OUTPUTS, encoder.encode(item)])

    def _send_now(self, frame: bytes, payload: bytes) -> None:
        self.out_sock.send_multipart([frame, payload])


def _error_text(prefix: str, e: BaseException) -> bytes:
    return f"{prefix}: {type(e).__name__}: {e}".encode()


def main() -> None:
    import pickle
    import sys

    input_addr, output_addr, parent_pid, level = sys.argv[1:5]
    config = pickle.loads(sys.stdin.buffer.read())
    run_engine_core(config, input_addr, output_addr, int(parent_pid), level)


if __name__ == "__main__":
    main()
