"""What crosses hosts in data parallel, and whom it trusts: TCP sockets between the head's
front end and remote engine cores, their CURVE keys, the typed messages between the head and
a `--headless` host, and the watcher of an engine core's connection to the head.

The head binds a handshake socket on `--data-parallel-address:--data-parallel-rpc-port`. A
`--headless` host asks it once per engine rank (`Hello`) and gets the two addresses that
rank's engine core connects to (`Welcome`); from then on the engine core talks to the head as a
local one does over `ipc://`, with the same frames, and the host tells the head on its
handshake connection, every `HEARTBEAT_S`, which of its engine cores run (`Beat`). Every TCP
socket of the head listens on the given address only. Nothing is unpickled: the handshake is
msgspec, the rest the engine's own frames.

Trust. Every TCP connection is CURVE-encrypted, and the head accepts a client only if it
proves the client key (ZAP): a process without the keys completes no handshake, so it can
neither take a rank, nor receive a frame, nor send one. The keys derive from a secret (scrypt,
salted with vserve and the key's role, once per process):

| `--data-parallel-address` | the secret                                                     |
|---------------------------|----------------------------------------------------------------|
| not loopback              | `VSERVE_DP_SECRET`, the same on every host, at least           |
|                           | `MIN_SECRET_CHARS` characters (required)                       |
| loopback, no secret set   | a random one per run: the head writes it to a file only its    |
|                           | user can read (`run_secret_path`), removed once its engines    |
|                           | are up or it exits; a headless host of the same user on the    |
|                           | same machine reads it there and hands it to its engine cores   |

Liveness. The head declares a remote engine dead when its host reports that the engine core
exited, or sends no `Beat` for `LIVENESS_TIMEOUT_S`. Only messages from the host that took the
rank count: a connection's coming or going is never read as an engine's fate, so a stranger's
connect, disconnect or silent connection changes nothing. An engine core, which connects to
the head (one authenticated peer), stops when that connection drops. ZMQ heartbeats run on
every connection, so a silent peer (its host gone) ends as a dropped connection.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.utils.monitor
import zmq.utils.z85

from vserve.cache_files import cache_dir
from vserve.envs import read_env

MIN_SECRET_CHARS = 16
HEARTBEAT_S = 1.0  # between a headless host's Beats, and between ZMQ's pings
LIVENESS_TIMEOUT_S = 10.0  # no Beat for this long: the host is dead or cut off
ZMQ_HEARTBEAT_TIMEOUT_MS = 10_000  # a connection that answers no ping this long is dropped
# scrypt at 32 MiB and about 0.15 s per key: a guess at a secret costs as much
SCRYPT_N, SCRYPT_R, SCRYPT_MAXMEM = 2**15, 8, 64 * 2**20


class Hello(msgspec.Struct, array_like=True, tag=True):
    """A headless host asks for one rank's addresses."""

    rank: int


class Beat(msgspec.Struct, array_like=True, tag=True):
    """A headless host's engine cores: the ranks that run, and the exit codes of those that
    stopped."""

    running: list[int]
    exited: dict[int, int] = {}


HostMessage = Hello | Beat  # what a headless host sends the head


class Welcome(msgspec.Struct, array_like=True, omit_defaults=True):
    input_addr: str = ""
    output_addr: str = ""
    error: str | None = None


def is_loopback(address: str) -> bool:
    try:
        return all(
            ipaddress.ip_address(info[4][0]).is_loopback
            for info in socket.getaddrinfo(address, None)
        )
    except (OSError, ValueError):
        return False


def check_secret(secret: str) -> None:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"VSERVE_DP_SECRET has {len(secret)} characters: give at least {MIN_SECRET_CHARS} "
            "(random ones: the data-parallel keys derive from it, and a short secret can be "
            "guessed offline from one captured handshake)"
        )


def check_remote_setup(address: str, rpc_port: int) -> None:
    """Refuse what would expose the engines: a non-loopback address without a secret, or a
    secret too short."""
    if not rpc_port:
        raise ValueError(
            "data parallel over several hosts needs --data-parallel-rpc-port (the head's "
            "handshake port)"
        )
    secret = read_env().dp_secret
    if secret is not None:
        check_secret(secret)
    elif not is_loopback(address):
        raise ValueError(
            f"--data-parallel-address {address} is not a loopback address: set the same "
            f"VSERVE_DP_SECRET (at least {MIN_SECRET_CHARS} characters) on every host (the "
            "connections are then encrypted and authenticated)"
        )


@functools.lru_cache(maxsize=8)
def _keypair(secret: str, role: str) -> tuple[bytes, bytes]:
    """The (public, secret) CURVE key of `role` ("server" or "client")."""
    check_secret(secret)
    seed = hashlib.scrypt(
        secret.encode(),
        salt=f"vserve data-parallel CURVE {role} key".encode(),
        n=SCRYPT_N,
        r=SCRYPT_R,
        p=1,
        maxmem=SCRYPT_MAXMEM,
        dklen=32,
    )
    private = zmq.utils.z85.encode(seed)
    return zmq.curve_public(private), private


def _heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ZMQ_HEARTBEAT_TIMEOUT_MS)  # the peer's limit for us


def secure_server(sock: zmq.Socket, secret: str) -> None:
    sock.curve_secretkey = _keypair(secret, "server")[1]
    sock.curve_server = True
    sock.zap_domain = b"vserve-dp"
    _heartbeats(sock)


def secure_client(sock: zmq.Socket, secret: str | None) -> None:
    """CURVE keys from `secret` (None: a local `ipc://` socket, left as it is)."""
    if secret:
        public, private = _keypair(secret, "client")
        sock.curve_serverkey = _keypair(secret, "server")[0]
        sock.curve_publickey, sock.curve_secretkey = public, private
        _heartbeats(sock)


class ZapAuthenticator:
    """The head's ZAP handler: a CURVE client is accepted only with the secret's client key."""

    def __init__(self, ctx: zmq.Context, secret: str) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        expected = _keypair(secret, "client")[0]

        class _Keys:
            def callback(self, domain, key) -> bool:
                return key == expected

        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback("vserve-dp", credentials_provider=_Keys())

    def stop(self) -> None:
        self.auth.stop()


def tcp_endpoint(address: str, port: int | str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"tcp://{host}:{port}"


def bind_tcp(sock: zmq.Socket, address: str, port: int = 0) -> str:
    """Bind on `address` only (never every interface); returns the endpoint bound."""
    sock.bind(tcp_endpoint(address, port or "*"))
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# -- the per-run secret of a loopback setup ------------------------------------------------------
def run_secret_path(address: str, port: int) -> Path:
    """Where the head on `address:port` keeps its per-run secret: a directory only its user may
    enter, under `$XDG_RUNTIME_DIR/vserve` (default: vserve's cache directory)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    root = cache_dir("dp")
    if runtime and os.path.isdir(runtime):
        root = Path(runtime) / "vserve" / "dp"
    name = "".join(c if c.isalnum() or c in ".-" else "_" for c in address)
    return root / f"{name}-{port}.key"


def _check_private(path: Path, st: os.stat_result, kind: str) -> None:
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"{path} ({kind} of the data-parallel secret) must belong to this user and be "
            "closed to everyone else"
        )


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path} is not a directory: it cannot hold the data-parallel secret")
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, 0o700)
        st = os.lstat(path)
    _check_private(path, st, "the directory")


def write_run_secret(address: str, port: int, secret: str) -> Path:
    """Write `secret` where a headless host on this machine finds it (0600, replaced at once:
    a reader never sees half of it)."""
    path = run_secret_path(address, port)
    _private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_run_secret(address: str, port: int) -> str | None:
    """The per-run secret of the head on `address:port`; None while it has written none. A file
    or directory that is not this user's alone is refused (ValueError)."""
    path = run_secret_path(address, port)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        _check_private(path.parent, os.lstat(path.parent), "the directory")
        _check_private(path, os.fstat(f.fileno()), "the file")
        return f.read().strip() or None


def remove_run_secret(path: Path, secret: str) -> None:
    """Remove the file if it still holds `secret` (a later head on the port may own it now)."""
    with contextlib.suppress(OSError):
        if path.read_text().strip() == secret:
            path.unlink()


# -- an engine core's connection to the head -----------------------------------------------------
_WATCHED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


def watch_disconnect(sock: zmq.Socket, on_gone: Callable[[], None], name: str) -> threading.Thread:
    """For a socket that connects to its one peer (an engine core's socket to the head): call
    `on_gone` once the connection, after its handshake succeeded, drops (the head shut down or
    died, or its pings stopped: ZMQ heartbeats), or the socket closes. Such a socket has one
    connection at a time, so every event is that connection's; a bound socket, which anyone
    may connect to, is no place for this (the head watches its hosts' `Beat`s instead)."""
    monitor = sock.get_monitor_socket(_WATCHED)

    def watch() -> None:
        connected = False
        try:
            while True:
                event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    connected = True
                elif event == zmq.EVENT_DISCONNECTED and connected:
                    return
                elif event == zmq.EVENT_MONITOR_STOPPED:
                    return
        except zmq.ZMQError:
            return
        finally:
            monitor.close(linger=0)
            on_gone()

    thread = threading.Thread(target=watch, daemon=True, name=name)
    thread.start()
    return thread
