"""The grammar compile worker: a child process of the engine core that compiles each new
structured-output constraint once, under a memory limit and a deadline, before the engine
core compiles it for use.

xgrammar compiles in native code that nothing can interrupt, and a constraint that parses in
a millisecond can still need minutes and tens of GB to compile (a regex of thousands of
alternatives against a 262k-token vocabulary: every state of its automaton gets a mask over
the vocabulary). Tried here first, such a compile ends in this process, killed at its deadline
or out of its address space, and fails only the requests that wait for it. A constraint that
passed compiles again in the engine core at the cost it showed here (a compile is
deterministic), so the engine core never starts a compile without a bound.

| message (msgpack, 4-byte length first)  | from -> to                     |
|-----------------------------------------|--------------------------------|
| `Setup`: the tokenizer's xgrammar info, | engine core -> worker, once    |
|   the memory budget                     |                                |
| `Verdict(ok=True)`: ready               | worker -> engine core, once    |
| `Job`: what to compile                  | engine core -> worker          |
| `Verdict`: compiled (its size) or why   | worker -> engine core          |
|   not                                   |                                |

The memory bound is watched from outside (the worker's resident memory, every 50 ms: killed
past its resident size when ready plus the budget) and, as a backstop for allocations faster
than that, set inside as an address-space limit.

The worker exits with its engine core (a lifeline thread: `vserve.host.lifeline`), on end of input,
and after an out-of-memory failure (the engine side starts a new one for the next job).
"""

from __future__ import annotations

import logging
import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgspec

logger = logging.getLogger("vserve.engine")

START_TIMEOUT_S = 120.0  # python, xgrammar and the tokenizer info: seconds, not minutes
WATCH_S = 0.05  # how often a compile's memory is looked at
_HEADER = struct.Struct("<I")


class Setup(msgspec.Struct, array_like=True):
    tokenizer_info: str  # xgrammar's TokenizerInfo.serialize_json()
    memory_bytes: int  # the compile's budget above what the worker holds when ready


class Job(msgspec.Struct, array_like=True):
    kind: str  # json | regex | ebnf (structured_output.grammar_source)
    source: str


class Verdict(msgspec.Struct, array_like=True, omit_defaults=True):
    ok: bool
    error: str | None = None  # the client's words: what is wrong with the constraint
    memory_bytes: int = 0  # the compiled grammar's size


class CompileWorker:
    """The engine core's handle on its compile worker: `check` runs one job to its verdict
    within a deadline; `kill` (from any thread) ends the job in flight. The process starts
    on first use and again after it was killed or died."""

    def __init__(
        self, tokenizer_info: str, memory_mb: int, started: subprocess.Popen[bytes] | None = None
    ) -> None:
        """`started`: a process from `spawn()` still importing, set up on first use (the
        engine core builds the tokenizer info the worker needs meanwhile)."""
        self._setup = msgspec.msgpack.encode(Setup(tokenizer_info, memory_mb << 20))
        self.memory_mb = memory_mb
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = started
        self._ready_rss = 0  # the worker's resident bytes when it was ready
        self._lock = threading.Lock()
        self.num_started = 0

    def check(self, job: Job, timeout: float) -> Verdict:
        """Compile `job` in the worker; a verdict even when the worker dies or hangs."""
        proc = self._running()
        limit = self._ready_rss + (self.memory_mb << 20)
        try:
            _write(proc, msgspec.msgpack.encode(job))
            reply = _read(proc, timeout, lambda: _resident_bytes(proc.pid) <= limit)
        except OSError:
            reply = None
        if reply is None and proc.poll() is None and _resident_bytes(proc.pid) <= limit:
            self._stop(proc)
            return Verdict(False, f"the grammar did not compile within {timeout:g} s")
        if reply is None:  # over its memory, out of address space, or killed by `kill`
            self._stop(proc)
            return Verdict(False, f"the grammar needs more than {self.memory_mb} MiB to compile")
        try:
            verdict = msgspec.msgpack.decode(reply, type=Verdict)
        except msgspec.DecodeError:  # the channel is out of step: start afresh
            self._stop(proc)
            raise RuntimeError("the grammar compile worker sent a reply it cannot read") from None
        if verdict.error is not None and "memory" in verdict.error:
            self._stop(proc)  # a native out-of-memory leaves nothing worth keeping
        return verdict

    def kill(self) -> None:
        """End the job in flight (its requests are gone); `check` then returns a failure."""
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            started, self._started = self._started, None
        for p in (proc, started):
            if p is not None:
                self._stop(p)

    def _running(self) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            proc, self._started = self._started, None
        proc = proc or spawn()
        try:
            _write(proc, self._setup)
            ready = _read(proc, START_TIMEOUT_S)
        except OSError:
            ready = None
        if ready is None or not msgspec.msgpack.decode(ready, type=Verdict).ok:
            self._stop(proc)
            raise RuntimeError("the grammar compile worker did not start")
        with self._lock:
            self._proc = proc
            self._ready_rss = _resident_bytes(proc.pid)
            self.num_started += 1
        return proc

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            if self._proc is proc:
                self._proc = None
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


_ENTRY = "from vserve.engine.grammar_worker import main; main()"


def _resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):  # gone, or no /proc: the deadline still holds
        return 0


def spawn() -> subprocess.Popen[bytes]:
    """A worker process: it imports xgrammar (python, torch: seconds) while it waits for its
    `Setup`."""
    # few malloc arenas: each reserves address space, which the worker's limit counts
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    return subprocess.Popen(
        [sys.executable, "-c", _ENTRY, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )


def _write(proc: subprocess.Popen[bytes], payload: bytes) -> None:
    assert proc.stdin is not None  # stdin=PIPE
    proc.stdin.write(_HEADER.pack(len(payload)) + payload)
    proc.stdin.flush()


def _read(
    proc: subprocess.Popen[bytes], timeout: float, healthy: Callable[[], bool] = lambda: True
) -> bytes | None:
    """One message from the worker; None at its end of output, past `timeout`, or as soon
    as `healthy()` (asked every `WATCH_S` seconds) says no."""
    assert proc.stdout is not None  # stdout=PIPE
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    header = _read_exactly(fd, _HEADER.size, deadline, healthy)
    if header is None:
        return None
    return _read_exactly(fd, _HEADER.unpack(header)[0], deadline, healthy)


def _read_exactly(fd: int, size: int, deadline: float, healthy: Callable[[], bool]) -> bytes | None:
    data = b""
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not healthy():
            return None
        if not select.select([fd], [], [], min(remaining, WATCH_S))[0]:
            continue
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# -- the worker process ----------------------------------------------------------------------
def _serve(stdin, stdout) -> None:
    import gc

    import xgrammar as xgr

    from vserve.host import heap

    first = _recv(stdin)
    if first is None:
        return
    setup = msgspec.msgpack.decode(first, type=Setup)
    info = xgr.TokenizerInfo.deserialize_json(setup.tokenizer_info)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    del setup.tokenizer_info
    gc.collect()
    heap.trim()  # the setup's garbage back, so that the budget counts from what is kept
    _limit_memory(setup.memory_bytes)
    _send(stdout, Verdict(True))
    while True:
        payload = _recv(stdin)
        if payload is None:
            return
        job = msgspec.msgpack.decode(payload, type=Job)
        verdict = _compile(compiler, job)
        _send(stdout, verdict)
        if verdict.error is not None and "memory" in verdict.error:
            return


def _compile(compiler, job: Job) -> Verdict:
    from vserve.engine.grammars import compile_source, xgrammar_reason
    from vserve.host import heap

    try:
        compiled = compile_source(compiler, job.kind, job.source)
    except MemoryError:
        return Verdict(False, "the grammar needs more memory to compile than it may use")
    except (RuntimeError, ValueError, UnicodeError) as e:  # xgrammar's: the constraint's fault
        return Verdict(False, f"cannot compile the grammar: {xgrammar_reason(e)}")
    size = compiled.memory_size_bytes
    del compiled
    heap.trim()
    return Verdict(True, memory_bytes=size)


def _limit_memory(budget: int) -> None:
    """Address space: what the worker holds now, plus the budget (a compile past it fails
    to allocate, in this process only)."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + budget
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _recv(stream) -> bytes | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    return payload if len(payload) == size else None


def _send(stream, verdict: Verdict) -> None:
    payload = msgspec.msgpack.encode(verdict)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def main() -> None:
    from vserve.host.lifeline import exit_with_parent

    exit_with_parent(int(sys.argv[1]))
    # the replies get a descriptor of their own; fd 1 (what native code may print to) and
    # Python's stdout go to stderr, so nothing else can write into the reply channel
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
