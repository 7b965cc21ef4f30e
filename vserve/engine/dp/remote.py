"""The head's side of remote data-parallel engines: per remote rank, two TCP sockets its
engine core connects to, and the socket where `--headless` hosts ask for their ranks and then
report on their engine cores (`dp/transport.py` has the wire rules and the trust model).

`RemoteEngine` is what `SyncMPClient` / `AsyncMPClient` drive instead of a local
`EngineProcess`: the same sockets and frames. There is no process to watch here: the engine
is gone when its host says its engine core exited, or when its host falls silent.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable

import msgspec
import zmq

from vserve.config import EngineConfig
from vserve.engine.dp.transport import (
    LIVENESS_TIMEOUT_S,
    Beat,
    HostMessage,
    Welcome,
    ZapAuthenticator,
    bind_tcp,
    check_secret,
    remove_run_secret,
    secure_server,
    write_run_secret,
)
from vserve.engine.messages import FRAME_DEAD, FRAME_READY, RequestType
from vserve.envs import ENV, read_env

logger = logging.getLogger("vserve")


class RemoteEngines:
    """The head's remote ranks: one context (with the ZAP handler), and the hosts' socket,
    served by one thread until `close`: it answers `Hello`s until `stop_handshakes`, and
    declares a rank's engine gone from its host's `Beat`s (see `_on_beat`, `_check_silence`)."""

    def __init__(self, config: EngineConfig) -> None:
        dp = config.data_parallel
        self.ranks = set(dp.remote_ranks)
        self.address = dp.address
        user_secret = read_env().dp_secret
        # no user secret (a loopback address): a random one for this run, in a private file
        self.secret = user_secret or secrets.token_urlsafe(32)
        check_secret(self.secret)
        self.liveness_timeout = LIVENESS_TIMEOUT_S
        self.ctx = zmq.Context()
        self.auth = ZapAuthenticator(self.ctx, self.secret)
        self.welcomes: dict[int, Welcome] = {}
        self.engines: dict[int, RemoteEngine] = {}
        self._lock = threading.Lock()
        self._taking = threading.Event()  # Hellos are answered
        self._taking.set()
        self._stop = threading.Event()
        self._sock = self.ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a host that reconnects keeps its ranks
        try:
            secure_server(self._sock, self.secret)
            endpoint = bind_tcp(self._sock, dp.address, dp.rpc_port)
            # written once the port is ours: a file left by a dead head is replaced
            path = None if user_secret else write_run_secret(dp.address, dp.rpc_port, self.secret)
        except BaseException:
            self._sock.close(linger=0)
            self.auth.stop()
            self.ctx.term()
            raise
        # removed at exit too, should no one close us
        self._forget_secret = (
            weakref.finalize(self, remove_run_secret, path, self.secret) if path else None
        )
        # the serve thread's own: who took each rank, and when that host last spoke for it
        self._pending: dict[int, bytes] = {}  # rank -> the host that asked, until it registers
        self._owners: dict[int, bytes] = {}
        self._last_beat: dict[int, float] = {}
        logger.info(
            "data parallel: waiting for engine ranks %s at %s", sorted(self.ranks), endpoint
        )
        self._thread = threading.Thread(target=self._serve, daemon=True, name="vserve-dp-hosts")
        self._thread.start()

    def factory(self, config: EngineConfig) -> Callable[[zmq.Context], RemoteEngine]:
        return lambda _ctx: RemoteEngine(config, self)

    def register(self, rank: int, welcome: Welcome, engine: RemoteEngine) -> None:
        with self._lock:
            self.welcomes[rank] = welcome
            self.engines[rank] = engine

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(HostMessage)
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    frames = self._sock.recv_multipart()
                    if len(frames) == 2:  # [host, message]: a DEALER's one frame
                        self._on_message(frames[0], frames[1], decoder)
                self._answer_pending()
                self._check_silence()
        finally:
            self._sock.close(linger=1000)

    def _on_message(self, host: bytes, payload: bytes, decoder) -> None:
        try:
            message = decoder.decode(payload)
        except msgspec.DecodeError as e:
            self._reply(host, Welcome(error=f"bad handshake: {e}"))
            return
        if isinstance(message, Beat):
            self._on_beat(host, message)
            return
        error = self._check(message.rank)
        if error is not None:
            self._reply(host, Welcome(error=error))
        else:
            self._pending[message.rank] = host

    def _check(self, rank: int) -> str | None:
        """Why a `Hello` for `rank` is refused (None: it is not)."""
        if not self._taking.is_set():
            return "the head takes no more engines (its start-up is over)"
        if rank not in self.ranks:
            return f"rank {rank} is not a remote rank of this head ({sorted(self.ranks)})"
        if rank in self._owners or rank in self._pending:
            return f"rank {rank} is already served by another host"
        return None

    def _answer_pending(self) -> None:
        with self._lock:
            ready = {r: self.welcomes[r] for r in self._pending if r in self.welcomes}
        for rank, welcome in ready.items():
            host = self._pending.pop(rank)
            self._reply(host, welcome)
            self._owners[rank] = host
            self._last_beat[rank] = time.monotonic()

    def _on_beat(self, host: bytes, beat: Beat) -> None:
        """Only the host that took a rank speaks for it."""
        now = time.monotonic()
        for rank in [r for r, owner in self._owners.items() if owner == host]:
            if rank in beat.exited:
                why = f"its engine core exited on its host (exit code {beat.exited[rank]})"
                self._declare_gone(rank, why)
            elif rank in beat.running:
                self._last_beat[rank] = now

    def _check_silence(self) -> None:
        now = time.monotonic()
        for rank in [r for r in self._owners if now - self._last_beat[r] > self.liveness_timeout]:
            why = (
                f"its host sent no heartbeat for {self.liveness_timeout:g} s (it died, or the "
                "network to it is down)"
            )
            self._declare_gone(rank, why)

    def _declare_gone(self, rank: int, why: str) -> None:
        del self._owners[rank]
        with self._lock:
            engine = self.engines.get(rank)
        if engine is not None:
            engine.set_gone(why)

    def _reply(self, host: bytes, welcome: Welcome) -> None:
        self._sock.send_multipart([host, msgspec.msgpack.encode(welcome)])

    def stop_handshakes(self) -> None:
        """Every rank is served (or the start-up failed): no more `Hello`s are answered, and
        the per-run secret's file goes. The hosts' `Beat`s are still read."""
        self._taking.clear()
        if self._forget_secret is not None:
            self._forget_secret()

    def close(self) -> None:
        if self.ctx.closed:
            return
        self.stop_handshakes()
        self._stop.set()
        self._thread.join(timeout=5)
        self.auth.stop()
        self.ctx.term()


class RemoteEngine:
    """One remote engine core, seen like a local `EngineProcess`."""

    def __init__(self, config: EngineConfig, remote: RemoteEngines) -> None:
        self.rank = config.data_parallel.engine_index
        self.name = f"data-parallel engine {self.rank} (remote)"
        self.stopping = threading.Event()  # set once we stop it: its exit is no error
        self._gone = threading.Event()
        self.gone_reason = "it was shut down"
        self._connected = False  # its engine core has spoken (READY or DEAD)
        self.input_sock = remote.ctx.socket(zmq.PUSH)
        self.output_sock = remote.ctx.socket(zmq.PULL)
        for sock in (self.input_sock, self.output_sock):
            secure_server(sock, remote.secret)
        welcome = Welcome(
            bind_tcp(self.input_sock, remote.address), bind_tcp(self.output_sock, remote.address)
        )
        remote.register(self.rank, welcome, self)
        self.info = self._handshake()

    @property
    def closing(self) -> bool:
        return self.stopping.is_set()

    def _handshake(self) -> dict:
        deadline = time.monotonic() + ENV.engine_ready_timeout
        while time.monotonic() < deadline:
            if self.output_sock.poll(200):
                frame, payload = self.output_sock.recv_multipart()
                self._connected = True
                if frame == FRAME_READY:
                    return msgspec.msgpack.decode(payload)
                if frame == FRAME_DEAD:
                    self.close()
                    raise RuntimeError(f"{self.name}: {payload.decode()}")
            if self._gone.is_set():
                self.close()
                raise RuntimeError(f"{self.name} disconnected during start-up: {self.gone_reason}")
        self.close()
        raise TimeoutError(
            f"{self.name} did not connect within {ENV.engine_ready_timeout:.0f} s: start "
            "`vserve serve --headless` on its host, with the same VSERVE_DP_SECRET"
        )

    def set_gone(self, why: str) -> None:
        """Its host said its engine core exited, or fell silent (the hosts' thread)."""
        if not self._gone.is_set():
            self.gone_reason = why
            self._gone.set()

    def alive(self) -> bool:
        return not self._gone.is_set()

    @property
    def exitcode(self) -> int | None:
        return None

    def wait_gone(self) -> str:
        self._gone.wait()
        return f"{self.name} disconnected: {self.gone_reason}"

    def kill(self) -> None:
        """A hung remote engine: ask it to stop (its host's launcher ends what remains)."""
        self._send_shutdown()

    def _send_shutdown(self) -> None:
        try:
            self.input_sock.send_multipart([bytes([RequestType.SHUTDOWN]), b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.stopping.set()
        if self.alive() and self._connected:
            self._send_shutdown()
            self._gone.wait(20)  # until its host reports the exit
        self.input_sock.close(linger=0)
        self.output_sock.close(linger=0)
        self.set_gone("it was shut down")

    def restore_cpus(self) -> None:
        pass
