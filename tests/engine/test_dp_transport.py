"""Whom the head of data parallel trusts, with bare ZMQ sockets in one process (no engine):
a process without the keys cannot take a rank, receive ADD frames, send frames, or make the
head declare an engine dead; a real engine's death is seen from its host's reports; the
per-run secret of a loopback head lives in a private file; short secrets are refused.

`Head` plays the head's side (`RemoteEngines`, one `RemoteEngine` for rank 1), `Host` a
headless host that holds the keys, `Engine` its engine core's two sockets."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from vserve.config import DataParallelConfig
from vserve.engine.dp.remote import RemoteEngine, RemoteEngines
from vserve.engine.dp.transport import (
    Beat,
    Hello,
    Welcome,
    check_remote_setup,
    read_run_secret,
    run_secret_path,
    secure_client,
)
from vserve.engine.messages import FRAME_OUTPUTS, FRAME_READY, RequestType
from vserve.executor.multiproc import free_port

RANK = 1
QUIET_S = 1.0  # how long a stranger gets to do harm
# a stranger taking a rank stays in the fast tier; the other strangers' tests wait out
# QUIET_S windows, and run in the slow tier
slow = pytest.mark.slow


def _endpoint_port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def _try_send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """A stranger's send: queued, or refused at once when its connection was already dropped
    at the handshake (it may never block the test)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def _frames_within(sock: zmq.Socket, seconds: float, count: int = -1) -> list[list[bytes]]:
    """What `sock` receives within `seconds` (or until it has `count` messages)."""
    got, deadline = [], time.monotonic() + seconds
    while len(got) != count and (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            got.append(sock.recv_multipart())
    return got


class Host:
    """A headless host: a DEALER to the head's handshake port, keyed by `secret` (None: no
    keys at all)."""

    def __init__(self, ctx: zmq.Context, port: int, secret: str | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        secure_client(self.sock, secret)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, rank: int, timeout: float = 10.0) -> Welcome | None:
        self.sock.send(msgspec.msgpack.encode(Hello(rank)))
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return msgspec.msgpack.decode(self.sock.recv(), type=Welcome)

    def beat(self, running: list[int], exited: dict[int, int] | None = None) -> None:
        self.sock.send(msgspec.msgpack.encode(Beat(running, exited or {})))


class Engine:
    """An engine core's sockets: PULL from the head's input, PUSH to its output."""

    def __init__(self, ctx: zmq.Context, welcome: Welcome, secret: str | None) -> None:
        self.input = ctx.socket(zmq.PULL)
        self.output = ctx.socket(zmq.PUSH)
        for sock, addr in ((self.input, welcome.input_addr), (self.output, welcome.output_addr)):
            secure_client(sock, secret)
            sock.connect(addr)

    def ready(self) -> None:
        self.output.send_multipart([FRAME_READY, msgspec.msgpack.encode({"num_kv_blocks": 8})])


class Head:
    def __init__(self) -> None:
        self.dp = DataParallelConfig(size=2, size_local=1, rpc_port=free_port())
        self.remote = RemoteEngines(SimpleNamespace(data_parallel=self.dp))
        self.ctx = zmq.Context()
        self.box: dict = {}
        config = SimpleNamespace(data_parallel=dataclasses.replace(self.dp, engine_index=RANK))
        self.thread = threading.Thread(
            target=lambda: self.box.update(engine=RemoteEngine(config, self.remote)), daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while RANK not in self.remote.welcomes and time.monotonic() < deadline:
            time.sleep(0.01)
        self.welcome = self.remote.welcomes[RANK]  # its sockets are bound, nothing connected

    def host(self, secret: str | None = "") -> Host:
        return Host(self.ctx, self.dp.rpc_port, self.remote.secret if secret == "" else secret)

    def engine(self, secret: str | None = "") -> Engine:
        return Engine(self.ctx, self.welcome, self.remote.secret if secret == "" else secret)

    def started(self, engine: Engine) -> RemoteEngine:
        """The head's `RemoteEngine` once `engine` said READY."""
        engine.ready()
        self.thread.join(timeout=10)
        return self.box["engine"]

    def take_rank(self) -> tuple[Host, Engine, RemoteEngine]:
        """The rank taken by a host with the keys, its engine connected and ready."""
        host = self.host()
        assert host.ask(RANK) == self.welcome
        engine = self.engine()
        return host, engine, self.started(engine)

    def close(self, host: Host | None = None) -> None:
        engine = self.box.get("engine")
        if engine is not None:
            if host is not None:
                host.beat([], {RANK: 0})  # as a host does once its engine core exits
            else:
                engine.set_gone("the test is over")
            engine.close()
        self.remote.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def loopback(monkeypatch, tmp_path):
    """A loopback setup without VSERVE_DP_SECRET; the per-run secret's file under tmp_path."""
    monkeypatch.delenv("VSERVE_DP_SECRET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


def test_a_stranger_cannot_take_a_rank(loopback):
    """A Hello before the real host's, without the keys or with wrong ones: no answer, and the
    rank stays free for the host that holds the keys."""
    head = Head()
    host = None
    try:
        strangers = [head.host(secret=None), head.host(secret="not-the-secret-of-this-run")]
        for stranger in strangers:
            _try_send(stranger.sock, [msgspec.msgpack.encode(Hello(RANK))])
        time.sleep(QUIET_S)
        assert [s.sock.poll(0) for s in strangers] == [0, 0]
        host = head.host()
        assert host.ask(RANK) == head.welcome  # not "already served by another host"
        head.started(head.engine())
    finally:
        head.close(host)


@slow
def test_a_stranger_cannot_receive_add_frames(loopback):
    """PULL sockets without the keys (or with wrong ones) on an engine's input get none of the
    head's frames: every one goes to the engine."""
    head = Head()
    host, engine, remote_engine = head.take_rank()
    try:
        strangers = [head.ctx.socket(zmq.PULL) for _ in range(2)]
        secure_client(strangers[1], "not-the-secret-of-this-run")
        for stranger in strangers:
            stranger.connect(head.welcome.input_addr)
        time.sleep(QUIET_S)  # their handshakes are over (failed)
        frames = [[bytes([RequestType.ADD]), b"request %d" % i] for i in range(20)]
        for frame in frames:
            remote_engine.input_sock.send_multipart(frame)
        assert [f for s in strangers for f in _frames_within(s, 0.5)] == []
        assert _frames_within(engine.input, 5.0, len(frames)) == frames
    finally:
        head.close(host)


@slow
def test_a_strangers_connect_and_disconnect_kills_no_engine(loopback):
    """Connections to the engine's sockets that come and go (bare TCP, ZMQ without keys, ZMQ
    with wrong keys) are no sign of the engine's death."""
    head = Head()
    host, engine, remote_engine = head.take_rank()
    try:
        for addr in (head.welcome.output_addr, head.welcome.input_addr):
            with socket.create_connection(("127.0.0.1", _endpoint_port(addr))):
                time.sleep(0.1)
            for secret in (None, "not-the-secret-of-this-run"):
                sock = head.ctx.socket(zmq.PUSH if addr == head.welcome.output_addr else zmq.PULL)
                secure_client(sock, secret)
                sock.connect(addr)
                time.sleep(0.3)
                sock.close(linger=0)
        time.sleep(QUIET_S)
        assert remote_engine.alive()
    finally:
        head.close(host)


@slow
def test_a_strangers_junk_frames_never_reach_the_head(loopback):
    """Frames a PUSH without the keys sends to an engine's output are never read by the head
    (a junk frame there would mark the engine dead); the engine's own still are."""
    head = Head()
    host, engine, remote_engine = head.take_rank()
    strangers: list[zmq.Socket] = []
    try:
        for secret in (None, "not-the-secret-of-this-run"):
            stranger = head.ctx.socket(zmq.PUSH)
            strangers.append(stranger)
            secure_client(stranger, secret)
            stranger.connect(head.welcome.output_addr)
            _try_send(stranger, [b"junk", b"\xc1"])
            _try_send(stranger, [FRAME_OUTPUTS, b"\xc1"])
        assert _frames_within(remote_engine.output_sock, QUIET_S) == []
        engine.output.send_multipart([FRAME_OUTPUTS, b"from the engine"])
        assert _frames_within(remote_engine.output_sock, 5.0, 1) == [
            [FRAME_OUTPUTS, b"from the engine"]
        ]
        assert remote_engine.alive()
    finally:
        for stranger in strangers:  # queued frames that can never go must not hold the close
            stranger.close(linger=0)
        head.close(host)


@slow
def test_a_silent_connection_before_the_engines_kills_no_engine(loopback):
    """A stranger's TCP connection to the engine's output, open before the engine connects
    and closed after: the engine's handshake is not credited to it, nor its close to the
    engine."""
    head = Head()
    host = head.host()
    try:
        silent = socket.create_connection(("127.0.0.1", _endpoint_port(head.welcome.output_addr)))
        time.sleep(0.2)
        assert host.ask(RANK) == head.welcome
        engine = head.engine()
        remote_engine = head.started(engine)
        silent.close()
        time.sleep(QUIET_S)
        assert remote_engine.alive()
        engine.output.send_multipart([FRAME_OUTPUTS, b"still here"])
        assert _frames_within(remote_engine.output_sock, 5.0, 1) == [[FRAME_OUTPUTS, b"still here"]]
    finally:
        head.close(host)


def test_the_engines_exit_reported_by_its_host_is_its_death(loopback):
    """The host that took the rank says its engine core exited: the head sees it at once, with
    the exit code. Another host (with the keys) cannot speak for that rank."""
    head = Head()
    host, engine, remote_engine = head.take_rank()
    try:
        other = head.host()
        assert "already served" in (other.ask(RANK).error or "")
        other.beat([], {RANK: 1})
        time.sleep(0.5)
        assert remote_engine.alive()
        host.beat([], {RANK: -9})
        deadline = time.monotonic() + 2
        while remote_engine.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not remote_engine.alive()
        message = remote_engine.wait_gone()
        assert "engine 1 (remote) disconnected" in message and "exit code -9" in message
    finally:
        head.close()


def test_a_silent_host_is_a_dead_engine(loopback):
    """Beats keep the engine alive; once they stop for the liveness timeout, it is dead (the
    host died, or the network to it is down)."""
    head = Head()
    head.remote.liveness_timeout = 1.0
    host, engine, remote_engine = head.take_rank()
    try:
        for _ in range(10):  # 2 s of beats
            host.beat([RANK])
            time.sleep(0.2)
        assert remote_engine.alive()
        silent_since = time.monotonic()
        while remote_engine.alive() and time.monotonic() - silent_since < 10:
            time.sleep(0.05)
        assert not remote_engine.alive()
        assert time.monotonic() - silent_since > 0.8
        assert "no heartbeat" in remote_engine.wait_gone()
    finally:
        head.close()


def test_the_per_run_secret_is_private_and_goes_when_the_engines_are_up(loopback, tmp_path):
    head = Head()
    host = None
    try:
        path = run_secret_path("127.0.0.1", head.dp.rpc_port)
        assert path.is_relative_to(tmp_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert read_run_secret("127.0.0.1", head.dp.rpc_port) == head.remote.secret
        host, engine, remote_engine = head.take_rank()
        head.remote.stop_handshakes()
        assert not path.exists()
    finally:
        head.close(host)


def test_a_secret_file_open_to_others_is_refused(loopback):
    head = Head()
    try:
        path = run_secret_path("127.0.0.1", head.dp.rpc_port)
        os.chmod(path, 0o644)
        with pytest.raises(ValueError, match="closed to everyone else"):
            read_run_secret("127.0.0.1", head.dp.rpc_port)
        head.started(head.engine())
    finally:
        head.close()


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3"])
def test_a_short_secret_is_refused(monkeypatch, address):
    monkeypatch.setenv("VSERVE_DP_SECRET", "x" * 15)
    with pytest.raises(ValueError, match="at least 16"):
        check_remote_setup(address, 13345)
    monkeypatch.setenv("VSERVE_DP_SECRET", "x" * 16)
    check_remote_setup(address, 13345)
