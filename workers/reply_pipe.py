"""Rank 0's replies to the engine core, written so that the worker never waits on a reader.

The engine core sends step N+1 before it reads step N's reply (async scheduling), and the
worker reads no request while it writes a reply. With blocking writes on both pipes, a reply
and a request that each exceed what a pipe holds (64 KiB on Linux: prompt logprobs one way,
new prompts or a grammar bitmask the other) stop both processes for good. Here a reply goes
out at once as far as the pipe takes it, without blocking; the rest is finished by a drain
thread, in order, while the main loop goes on to read the next request.

Frames are those of `multiprocessing.Connection.send_bytes`, so the engine core reads them
with `recv_bytes`.
"""

from __future__ import annotations

import os
import select
import struct
import threading
from collections import deque

_INT32_MAX = 0x7FFFFFFF
_SHORT = 16384  # up to this size a reply is copied behind its header: one write


def frame(data: bytes) -> list[memoryview]:
    """The bytes `Connection.send_bytes(data)` writes: a signed 32-bit size (-1 then an
    unsigned 64-bit one past 2 GiB), then the data (a short one in the same write)."""
    n = len(data)
    if n <= _SHORT:
        return [memoryview(struct.pack("!i", n) + data)]
    header = struct.pack("!i", n) if n <= _INT32_MAX else struct.pack("!iQ", -1, n)
    return [memoryview(header), memoryview(data)]


class ReplyPipe:
    """The write end of the reply pipe: `send` never blocks on the engine core."""

    def __init__(self, conn) -> None:
        self._conn = conn  # owns the descriptor
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._backlog: deque[memoryview] = deque()
        self._cond = threading.Condition()
        self._error: OSError | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._drain, daemon=True, name="vserve-reply-pipe")
        self._thread.start()

    def send(self, data: bytes) -> None:
        """Queue one reply and write what the pipe takes now; OSError: the engine core is
        gone (now or at an earlier write)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            self._backlog.extend(frame(data))
            self._flush()
            if self._error is not None:
                raise self._error
            if self._backlog:
                self._cond.notify()

    def close(self, timeout: float) -> None:
        """Let the drain thread finish what is queued (up to `timeout` seconds), then close."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        self._conn.close()

    def _flush(self) -> None:
        """Write from the head of the backlog until it is empty or the pipe is full (the
        caller holds the lock, so the frames stay in order whoever writes them)."""
        try:
            while self._backlog:
                head = self._backlog[0]
                written = os.write(self._fd, head)
                if written == len(head):
                    self._backlog.popleft()
                else:
                    self._backlog[0] = head[written:]
        except BlockingIOError:
            pass
        except OSError as e:  # the read end is closed: nothing more can be delivered
            self._error = e
            self._backlog.clear()

    def _drain(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        while True:
            with self._cond:
                while not self._backlog and not self._closing:
                    self._cond.wait()
                if not self._backlog:
                    return
            poller.poll()  # writable, or the read end closed (the write then says so)
            with self._cond:
                self._flush()
