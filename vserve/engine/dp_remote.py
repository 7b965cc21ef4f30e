"""The head's side of remote data-parallel engines: per remote rank, two TCP sockets its
engine core connects to, and the handshake server that tells a `--headless` host where they
are (`dp_transport.py` has the wire rules and the security).

`RemoteEngine` is what `SyncMPClient` / `AsyncMPClient` drive instead of a local
`_EngineProcess`: the same sockets and frames; there is no process to watch here, so the
engine is gone when its connection drops (its process died, or its host went away).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from vserve.config import EngineConfig
from vserve.engine.core_proc import FRAME_DEAD, FRAME_READY
from vserve.engine.dp_transport import (
    Hello,
    Welcome,
    ZapAuthenticator,
    bind_tcp,
    secure_server,
    watch_disconnect,
)
from vserve.engine.messages import RequestType
from vserve.envs import ENV, read_env

logger = logging.getLogger("vserve")


class RemoteEngines:
    """The head's remote ranks: one context (with the ZAP handler), the handshake server."""

    def __init__(self, config: EngineConfig) -> None:
        dp = config.data_parallel
        self.ranks = set(dp.remote_ranks)
        self.address = dp.address
        self.secret = read_env().dp_secret
        self.ctx = zmq.Context()
        self.auth = ZapAuthenticator(self.ctx, self.secret) if self.secret else None
        self.welcomes: dict[int, Welcome] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = self.ctx.socket(zmq.ROUTER)
        secure_server(self._sock, self.secret)
        endpoint = bind_tcp(self._sock, dp.address, dp.rpc_port)
        logger.info(
            "data parallel: waiting for engine ranks %s at %s", sorted(self.ranks), endpoint
        )
        self._thread = threading.Thread(target=self._serve, daemon=True, name="vserve-dp-handshake")
        self._thread.start()

    def factory(self, config: EngineConfig) -> Callable[[zmq.Context], RemoteEngine]:
        return lambda _ctx: RemoteEngine(config, self)

    def register(self, rank: int, welcome: Welcome) -> None:
        with self._lock:
            self.welcomes[rank] = welcome

    def _serve(self) -> None:
        pending: dict[int, bytes] = {}  # rank -> the identity of the host that asked
        claimed: set[int] = set()
        decoder = msgspec.msgpack.Decoder(Hello)
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    ident, payload = self._sock.recv_multipart()[:2]
                    error = self._check(payload, decoder, claimed | set(pending))
                    if isinstance(error, str):
                        self._reply(ident, Welcome(error=error))
                    else:
                        pending[error] = ident
                with self._lock:
                    ready = {r: self.welcomes[r] for r in pending if r in self.welcomes}
                for rank, welcome in ready.items():
                    self._reply(pending.pop(rank), welcome)
                    claimed.add(rank)
        finally:
            self._sock.close(linger=1000)

    def _check(self, payload: bytes, decoder, taken: set[int]) -> int | str:
        """The rank asked for, or why it is refused."""
        try:
            rank = decoder.decode(payload).rank
        except msgspec.DecodeError as e:
            return f"bad handshake: {e}"
        if rank not in self.ranks:
            return f"rank {rank} is not a remote rank of this head ({sorted(self.ranks)})"
        if rank in taken:
            return f"rank {rank} is already served by another host"
        return rank

    def _reply(self, ident: bytes, welcome: Welcome) -> None:
        self._sock.send_multipart([ident, msgspec.msgpack.encode(welcome)])

    def stop_handshakes(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def close(self) -> None:
        if self.ctx.closed:
            return
        self.stop_handshakes()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class RemoteEngine:
    """One remote engine core, seen like a local `_EngineProcess`."""

    def __init__(self, config: EngineConfig, remote: RemoteEngines) -> None:
        self.rank = config.data_parallel.engine_index
        self.name = f"data-parallel engine {self.rank} (remote)"
        self.stopping = threading.Event()  # set once we stop it: its exit is no error
        self._gone = threading.Event()
        ctx, secret = remote.ctx, remote.secret
        self.input_sock = ctx.socket(zmq.PUSH)
        self.output_sock = ctx.socket(zmq.PULL)
        for sock in (self.input_sock, self.output_sock):
            secure_server(sock, secret)
        # watched before anyone can connect: a dropped connection is the engine's death
        watch_disconnect(self.output_sock, self._gone.set, f"vserve-dp-watch-{self.rank}")
        welcome = Welcome(
            bind_tcp(self.input_sock, remote.address), bind_tcp(self.output_sock, remote.address)
        )
        remote.register(self.rank, welcome)
        self.info = self._handshake()

    @property
    def closing(self) -> bool:
        return self.stopping.is_set()

    def _handshake(self) -> dict:
        deadline = time.monotonic() + ENV.engine_ready_timeout
        while time.monotonic() < deadline:
            if self.output_sock.poll(200):
                frame, payload = self.output_sock.recv_multipart()
                if frame == FRAME_READY:
                    return msgspec.msgpack.decode(payload)
                if frame == FRAME_DEAD:
                    self.close()
                    raise RuntimeError(f"{self.name}: {payload.decode()}")
        self.close()
        raise TimeoutError(
            f"{self.name} did not connect within {ENV.engine_ready_timeout:.0f} s: start "
            "`vserve serve --headless` on its host, with the same VSERVE_DP_SECRET"
        )

    def alive(self) -> bool:
        return not self._gone.is_set()

    @property
    def exitcode(self) -> int | None:
        return None

    def wait_gone(self) -> str:
        self._gone.wait()
        return f"{self.name} disconnected (its engine core died or its host is unreachable)"

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
        if self.alive():
            self._send_shutdown()
            self._gone.wait(20)
        self.input_sock.close(linger=0)
        self.output_sock.close(linger=0)
        self._gone.set()

    def restore_cpus(self) -> None:
        pass
