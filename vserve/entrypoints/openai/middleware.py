"""The server's front door, as plain ASGI middleware (no `BaseHTTPMiddleware`, which would
hide the client's disconnect from the handlers and buffer streams).

In order: a `Host` header the server does not answer to gets 400 (DNS rebinding: a web page
whose name resolves to the server's address would otherwise reach a key-less server as if it
were same-origin; see `HostPolicy`); while draining (SIGTERM) everything but `/metrics` and
`/health` gets 503; `/v1` routes, `/tokenize` and `/detokenize` need `Authorization: Bearer
<key>` when API keys are set (compared as SHA-256 digests in constant time; `/health`,
`/ping`, `/metrics`, `/version` and CORS preflights stay open); a body longer than
`--max-request-body-bytes` gets 413, from its Content-Length before it is read, or as soon
as the bytes received pass the limit; a body that takes longer than `--request-body-timeout`
to arrive gets 408; bodies beyond their first `FREE_BODY_BYTES` share
`--max-pending-body-bytes` while they arrive and until they are parsed (past it: 503 +
Retry-After), so stalled uploads and queued parses cannot hold unbounded memory, and small
requests are never refused for them; every request gets an id -- the client's
`X-Request-Id` when it sends a usable one -- which the handlers use as the base of the engine
request id and which is echoed in the response.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import re
import socket
from dataclasses import dataclass

from vserve.entrypoints.openai.errors import APIError, error_body
from vserve.entrypoints.openai.protocol import random_id
from vserve.entrypoints.openai.serving_base import ServerContext

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_KEYED_PATHS = ("/tokenize", "/detokenize")  # besides everything under /v1
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
FREE_BODY_BYTES = 64 * 1024  # of each body, not counted against --max-pending-body-bytes


@dataclass(frozen=True)
class HostPolicy:
    """The `Host` values the server answers to. DNS rebinding needs a name the attacker
    controls, so an IP address is safe to accept: a loopback address always, any address when
    the server listens beyond loopback; names must be known: the loopback names, the
    machine's own names, and `--allowed-hosts` ('*': any)."""

    names: frozenset[str] | None  # None: any Host
    any_ip: bool = True  # False: loopback addresses only

    def allows(self, host: str | None) -> bool:
        if self.names is None or host is None:  # no Host header: no browser sent it
            return True
        name = _host_name(host)
        if name in self.names:
            return True
        ip = _ip(name)
        return ip is not None and (self.any_ip or ip.is_loopback)


def host_policy(bind_host: str, allowed: list[str] | None) -> HostPolicy:
    """`--allowed-hosts` when given ('*': any); else the loopback names, and when the server
    listens beyond loopback (`0.0.0.0`, an interface) also this machine's names, the bind
    address and any IP address; a loopback server takes loopback addresses only."""
    if allowed:
        if "*" in allowed:
            return HostPolicy(None)
        return HostPolicy(frozenset(_host_name(h) for h in allowed))
    names = set(LOOPBACK_NAMES)
    bind = bind_host.strip("[]").lower()
    ip = _ip(bind)
    if bind in LOOPBACK_NAMES or (ip is not None and ip.is_loopback):
        return HostPolicy(frozenset(names), any_ip=False)
    names |= {bind, socket.gethostname().lower()}  # no DNS lookup at start-up
    names.discard("")
    return HostPolicy(frozenset(names))


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _host_name(value: str) -> str:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class FrontDoor:
    def __init__(
        self,
        app,
        ctx: ServerContext,
        api_keys: list[str] | None = None,
        hosts: HostPolicy | None = None,
    ) -> None:
        self.app = app
        self.ctx = ctx
        self.digests = [_digest(k.strip()) for k in api_keys or []]  # as tokens are read
        self.hosts = hosts or HostPolicy(None)
        self.max_body = ctx.limits.max_request_body_bytes
        self.pending_bytes = 0  # of bodies arriving, beyond each one's FREE_BODY_BYTES

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if not self.hosts.allows(_header(scope, b"host")):
            await _send_json(
                send, 400, error_body(400, "Invalid Host header (see --allowed-hosts).")
            )
            return
        if self.ctx.draining and path not in ("/metrics", "/health"):
            await _send_json(
                send, 503, error_body(503, "The server is shutting down."), [(b"retry-after", b"1")]
            )
            return
        if (
            self.digests
            and (path.startswith("/v1") or path in _KEYED_PATHS)
            and scope["method"] != "OPTIONS"
            and not self._authorized(scope)
        ):
            await _send_json(
                send, 401, error_body(401, "Unauthorized"), [(b"www-authenticate", b"Bearer")]
            )
            return
        if self._declared_too_large(scope):
            await _send_json(send, 413, error_body(413, self._too_large_message()))
            return
        body = _Body(self)
        request_id = _client_request_id(scope) or random_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["body_budget"] = body  # the body parser gives its share back once parsed
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, body.receiver(receive), send_with_id)
        finally:
            body.release()

    def _declared_too_large(self, scope) -> bool:
        length = _header(scope, b"content-length")
        return length is not None and length.strip().isdigit() and int(length) > self.max_body

    def _too_large_message(self) -> str:
        return f"The request body is larger than {self.max_body} bytes (--max-request-body-bytes)."

    def _authorized(self, scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = _digest(token.strip())
        # compare against every key, so timing does not tell which one nearly matched
        return sum(hmac.compare_digest(digest, d) for d in self.digests) > 0


class _Body:
    """One request's body as it arrives: 413 past --max-request-body-bytes (whatever its
    Content-Length said), 408 past --request-body-timeout, 503 when the bytes beyond its
    first FREE_BODY_BYTES would take all bodies past --max-pending-body-bytes. Its bytes count
    until the body is parsed (`release`, by the parser) or the request ends. Nothing beyond a
    limit is kept; once the body is complete, `receive` (disconnect waits) is untimed."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.received = 0
        self.counted = 0  # our share of door.pending_bytes
        self.done = False
        self.deadline: float | None = None

    def receiver(self, receive):
        async def counted():
            if self.done:
                return await receive()
            loop = asyncio.get_running_loop()
            limits = self.door.ctx.limits
            if self.deadline is None:
                self.deadline = loop.time() + limits.request_body_timeout
            try:
                message = await asyncio.wait_for(receive(), self.deadline - loop.time())
            except asyncio.TimeoutError:
                self.release()
                raise APIError(
                    408,
                    f"The request body did not arrive within {limits.request_body_timeout:g} s "
                    "(--request-body-timeout).",
                ) from None
            if message["type"] == "http.request":
                self._add(len(message.get("body", b"")))
                self.done = not message.get("more_body", False)
            else:  # the client left: nothing more arrives, and nothing will be parsed
                self.done = True
                self.release()
            return message

        return counted

    def _add(self, size: int) -> None:
        door = self.door
        self.received += size
        if self.received > door.max_body:
            self.release()
            raise APIError(413, door._too_large_message())
        share = max(0, self.received - FREE_BODY_BYTES) - self.counted
        limit = door.ctx.limits.max_pending_body_bytes
        if share and door.pending_bytes + share > limit:
            self.release()
            raise APIError(
                503,
                f"The server is receiving too many large request bodies ({limit} bytes, "
                "--max-pending-body-bytes). Retry later.",
                headers={"Retry-After": "1"},
            )
        door.pending_bytes += share
        self.counted += share

    def release(self) -> None:
        self.door.pending_bytes -= self.counted
        self.counted = 0


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _client_request_id(scope) -> str | None:
    value = _header(scope, b"x-request-id")
    return value if value and _REQUEST_ID.match(value) else None


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
