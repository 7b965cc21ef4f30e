"""`vserve serve --headless`: a host that runs data-parallel engines for a head elsewhere and
no API server.

Over one connection to the head's handshake port (`HeadLink`) it asks, for each local rank
(`--data-parallel-start-rank` .. + `--data-parallel-size-local`), where that rank's sockets
are, then starts the engine core (`spawn_engine_core`, as a local front end
does), which connects to them; on the same connection it tells the head every `HEARTBEAT_S`
which engine cores run, and at once when one exits (the head's only sign of their fate).
Without `VSERVE_DP_SECRET` (a loopback head) the keys come from the head's per-run secret,
read from its private file, and go to the engine cores in their environment.
It returns when its engines have stopped: 0 when the head shut them down; 1 when one failed
(the others are stopped first, unless `--data-parallel-keep-serving`). SIGTERM or Ctrl-C stops
them (SIGTERM, then SIGKILL after `STOP_GRACE_S`); they also exit if this process dies, and
when the head's connection drops.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import time

import msgspec
import zmq

from vserve.config import EngineConfig
from vserve.engine.core_launcher import spawn_engine_core
from vserve.engine.dp.transport import (
    HEARTBEAT_S,
    Beat,
    Hello,
    Welcome,
    check_remote_setup,
    read_run_secret,
    secure_client,
    tcp_endpoint,
)
from vserve.envs import read_env

logger = logging.getLogger("vserve")
STOP_GRACE_S = 10.0


def run_headless(config: EngineConfig) -> int:
    dp = config.data_parallel
    check_remote_setup(dp.address, dp.rpc_port)
    if dp.size_local < 1:
        raise ValueError("--headless needs --data-parallel-size-local >= 1")
    stop: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda s, _f: stop.append(s))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    procs: dict[int, subprocess.Popen] = {}
    link = HeadLink(dp.address, dp.rpc_port, stop)
    try:
        for rank in dp.local_ranks:
            welcome = link.ask(rank, procs)
            if welcome is None:
                return 128 + stop[0]
            engine_config = dataclasses.replace(
                config, data_parallel=dataclasses.replace(dp, engine_index=rank)
            )
            procs[rank] = _spawn(engine_config, welcome, link.secret)
            logger.warning("data-parallel engine %d started for the head %s", rank, dp.address)
        return _supervise(procs, stop, dp.keep_serving, link)
    finally:
        _stop_all(procs)
        link.close(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class HeadLink:
    """This host's connection to the head: `Hello` per rank, then `Beat`s."""

    def __init__(self, address: str, port: int, stop: list[int]) -> None:
        self.address, self.port, self.stop = address, port, stop
        self.user_secret = read_env().dp_secret
        self.secret: str | None = None  # the one the socket's keys derive from
        self.confirmed = False  # the head answered: the keys are right
        self.ctx = zmq.Context()
        self.identity = b"host-" + os.urandom(8).hex().encode()
        self.sock: zmq.Socket | None = None
        self._next_beat = 0.0

    def _find_secret(self) -> str | None:
        """The user's secret, else the head's per-run one (None: not written yet)."""
        return self.user_secret or read_run_secret(self.address, self.port)

    def _connect(self, secret: str) -> zmq.Socket:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        # one identity for this host's run: a connection that drops and comes back is still
        # the host that took its ranks (the head hands the identity over to it)
        self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        secure_client(self.sock, secret)
        self.sock.connect(tcp_endpoint(self.address, self.port))
        self.secret = secret
        return self.sock

    def ask(self, rank: int, procs: dict[int, subprocess.Popen]) -> Welcome | None:
        """The addresses of `rank`'s sockets on the head (which may not be up yet: the request
        waits for it); None when a signal came first. Until the head first answers, a change
        of its per-run secret (a new head on the port) means asking again with the new keys."""
        timeout = read_env().engine_ready_timeout
        deadline = time.monotonic() + timeout
        asked_with: str | None = None
        while time.monotonic() < deadline and not self.stop:
            secret = self.secret if self.confirmed else self._find_secret()
            if secret is None:
                time.sleep(0.2)
                continue
            sock = self.sock
            if sock is None or secret != self.secret:
                sock = self._connect(secret)
            if secret != asked_with:
                sock.send(msgspec.msgpack.encode(Hello(rank)))
                asked_with = secret
            self.beat(procs)
            if sock.poll(200):
                welcome = msgspec.msgpack.decode(sock.recv(), type=Welcome)
                if welcome.error:
                    raise ValueError(f"the head refused data-parallel rank {rank}: {welcome.error}")
                self.confirmed = True
                return welcome
        if self.stop:
            return None
        hint = "is VSERVE_DP_SECRET the same on both hosts?"
        if self.user_secret is None:
            hint = "does the same user run both on this host?"
        raise TimeoutError(
            f"no answer from the head at {self.address}:{self.port} within {timeout:.0f} s (is "
            f"it running? {hint})"
        )

    def beat(self, procs: dict[int, subprocess.Popen], now: bool = False) -> None:
        """Tell the head which engine cores run and how the others ended: every `HEARTBEAT_S`,
        or `now`."""
        if self.sock is None or not self.confirmed or not procs:
            return
        if not now and time.monotonic() < self._next_beat:
            return
        codes = {r: p.poll() for r, p in procs.items()}
        beat = Beat(
            [r for r, c in codes.items() if c is None],
            {r: c for r, c in codes.items() if c is not None},
        )
        try:
            self.sock.send(msgspec.msgpack.encode(beat), flags=zmq.NOBLOCK)
        except zmq.Again:  # the head is gone or slow: its engines see to themselves
            pass
        self._next_beat = time.monotonic() + HEARTBEAT_S

    def close(self, procs: dict[int, subprocess.Popen]) -> None:
        """A last `Beat` with every exit code, then the connection closes."""
        self.beat(procs, now=True)
        if self.sock is not None:
            self.sock.close(linger=1000)
        self.ctx.term()


def _spawn(config: EngineConfig, welcome: Welcome, secret: str | None) -> subprocess.Popen:
    """The engine core, with the keys' secret in its environment (this user's alone)."""
    saved = os.environ.get("VSERVE_DP_SECRET")
    if secret:
        os.environ["VSERVE_DP_SECRET"] = secret
    try:
        return spawn_engine_core(config, welcome.input_addr, welcome.output_addr)
    finally:
        if saved is None:
            os.environ.pop("VSERVE_DP_SECRET", None)
        else:
            os.environ["VSERVE_DP_SECRET"] = saved


def _supervise(
    procs: dict[int, subprocess.Popen], stop: list[int], keep_serving: bool, link: HeadLink
) -> int:
    last: dict[int, int | None] = {}
    while True:
        if stop:
            return 128 + stop[0]
        codes = {r: p.poll() for r, p in procs.items()}
        link.beat(procs, now=codes != last)
        last = codes
        failed = [r for r, c in codes.items() if c not in (None, 0)]
        if failed and not (keep_serving and None in codes.values()):
            logger.error(
                "data-parallel engine(s) %s failed (exit codes %s)",
                failed,
                [codes[r] for r in failed],
            )
            return 1
        if None not in codes.values():
            return 1 if failed else 0
        time.sleep(0.2)


def _stop_all(procs: dict[int, subprocess.Popen]) -> None:
    from vserve.engine.core_launcher import kill_group

    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            kill_group(proc)
            proc.wait()
