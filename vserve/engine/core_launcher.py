"""The engine core's process: start it, hand it its config, wait for its READY (with a
timeout, watching the process), and stop it, its workers included, leaving no orphan.

The core starts as a fresh interpreter (`vserve.engine.core_proc`'s `main()`) in its own process
group, which its workers join, so one signal ends the whole tree. The front end binds the two
ZMQ sockets on `ipc://` paths inside a private temporary directory (mode 0700) first; the
clients (`mp_client.py`) then talk to the core over them.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from vserve.config import EngineConfig
from vserve.engine.messages import FRAME_DEAD, FRAME_READY, RequestType
from vserve.envs import ENV
from vserve.host.affinity import pin_process, process_cpus

READY_TIMEOUT_S = ENV.engine_ready_timeout


class EngineProcess:
    """Starts the engine core, owns the socket paths, does the handshake and cleans up.

    The core starts as a fresh interpreter (`spawn_engine_core`) that reads its config from
    stdin: a spawn that never re-imports the user's script, so `LLM(...)` works in scripts
    without a `__main__` guard, in notebooks and under `python -c`."""

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
        kill_group(self.proc)

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
            kill_group(self.proc)
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
    """`vserve.engine.core_proc`'s `main()` in a fresh interpreter, with the config on its
    stdin (a local pipe), in its own process group, which its workers join: one signal ends
    the whole tree. Run with `-c`, not `-m`: multiprocessing's spawn imports a `-m` main
    module again in every child, and the workers need none of the core's modules (0.2 s of
    each worker's start-up)."""
    level = logging.getLevelName(logging.getLogger("vserve").getEffectiveLevel())
    proc: subprocess.Popen[bytes] = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from vserve.engine.core_proc import main; main()",
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
            kill_group(proc)
            proc.wait()
    shutil.rmtree(tmpdir, ignore_errors=True)


# Python 3.11 names it; before, a new session does the same for a non-interactive child
_NEW_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)


def kill_group(proc: subprocess.Popen) -> None:
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
