"""What crosses hosts in data parallel: TCP sockets between the head's front end and remote
engine cores, CURVE keys derived from `VSERVE_DP_SECRET`, the typed handshake messages, and a
watcher that reports a dropped connection.

The head binds a handshake socket on `--data-parallel-address:--data-parallel-rpc-port`. A
`--headless` host asks it once per engine rank (`Hello`) and gets the two addresses that
rank's engine core connects to (`Welcome`); from then on the engine core talks to the head as a
local one does over `ipc://`, with the same frames. Every TCP socket of the head listens on the
given address only. With a secret, every connection is CURVE-encrypted and the head accepts
only clients that hold the secret (ZAP); without one, only a loopback address is allowed.
Nothing is unpickled: the handshake is msgspec, the rest the engine's own frames.
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
import threading
from collections.abc import Callable

import msgspec
import zmq
import zmq.utils.monitor
import zmq.utils.z85

from vserve.envs import read_env


class Hello(msgspec.Struct, array_like=True):
    rank: int


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


def check_remote_setup(address: str, rpc_port: int) -> None:
    """Refuse what would expose the engines: a non-loopback address without a secret."""
    if not rpc_port:
        raise ValueError(
            "data parallel over several hosts needs --data-parallel-rpc-port (the head's "
            "handshake port)"
        )
    if not read_env().dp_secret and not is_loopback(address):
        raise ValueError(
            f"--data-parallel-address {address} is not a loopback address: set the same "
            "VSERVE_DP_SECRET on every host (the connections are then encrypted and "
            "authenticated)"
        )


def _keypair(secret: str, role: str) -> tuple[bytes, bytes]:
    digest = hashlib.sha256(f"vserve-dp-{role}\0{secret}".encode()).digest()
    private = zmq.utils.z85.encode(digest)
    return zmq.curve_public(private), private


def secure_server(sock: zmq.Socket, secret: str | None) -> None:
    if secret:
        sock.curve_secretkey = _keypair(secret, "server")[1]
        sock.curve_server = True
        sock.zap_domain = b"vserve-dp"


def secure_client(sock: zmq.Socket, secret: str | None) -> None:
    if secret:
        public, private = _keypair(secret, "client")
        sock.curve_serverkey = _keypair(secret, "server")[0]
        sock.curve_publickey, sock.curve_secretkey = public, private


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


def bind_tcp(sock: zmq.Socket, address: str, port: int = 0) -> str:
    """Bind on `address` only (never every interface); returns the endpoint bound."""
    host = f"[{address}]" if ":" in address else address
    sock.bind(f"tcp://{host}:{port or '*'}")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_WATCHED = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_ACCEPTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | _HANDSHAKE_FAILED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_MONITOR_STOPPED
)


def watch_disconnect(sock: zmq.Socket, on_gone: Callable[[], None], name: str) -> threading.Thread:
    """Call `on_gone` once a peer disconnects (its process died or shut down, or its host is
    gone), or the socket closes. A stranger refused at the handshake is no peer: handshake
    events carry no descriptor, so each is matched to the oldest connection waiting for one,
    and only the disconnects of connections refused that way, or still waiting, are ignored."""
    monitor = sock.get_monitor_socket(_WATCHED)

    def watch() -> None:
        waiting: list[int] = []  # descriptors of connections not through the handshake
        refused: set[int] = set()
        try:
            while True:
                msg = zmq.utils.monitor.recv_monitor_message(monitor)
                event, fd = msg["event"], msg["value"]
                if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                    waiting.append(fd)
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and waiting:
                    waiting.pop(0)
                elif event & _HANDSHAKE_FAILED and waiting:
                    refused.add(waiting.pop(0))
                elif event == zmq.EVENT_DISCONNECTED:
                    if fd in refused or fd in waiting:
                        refused.discard(fd)
                        waiting = [w for w in waiting if w != fd]
                        continue
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
