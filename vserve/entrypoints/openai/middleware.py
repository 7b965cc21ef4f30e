"""The server's front door, as plain ASGI middleware (no `BaseHTTPMiddleware`, which would
hide the client's disconnect from the handlers and buffer streams).

In order: a `Host` header outside `--allowed-hosts` gets 400 (DNS rebinding: a web page
whose name resolves to 127.0.0.1 would otherwise reach a key-less local server as if it were
same-origin); while draining (SIGTERM) everything but `/metrics` and `/health` gets 503; `/v1`
routes, `/tokenize` and `/detokenize` need `Authorization: Bearer <key>` when API keys are set
(compared as SHA-256 digests in constant time; `/health`, `/ping`, `/metrics`, `/version` and
CORS preflights stay open); a body longer than `--max-request-body-bytes` gets 413, from its
Content-Length before it is read, or as soon as the bytes received pass the limit; every
request gets an id -- the client's `X-Request-Id` when it sends a usable one -- which the
handlers use as the base of the engine request id and which is echoed in the response.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re

from vserve.entrypoints.openai.errors import APIError, error_body
from vserve.entrypoints.openai.protocol import random_id
from vserve.entrypoints.openai.serving_base import ServerContext

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_KEYED_PATHS = ("/tokenize", "/detokenize")  # besides everything under /v1
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str, allowed: list[str] | None) -> list[str] | None:
    """The Host values to serve: the given list ('*' = all); by default the loopback names
    when the server listens on a loopback address, else all (None)."""
    if allowed:
        return None if "*" in allowed else allowed
    if bind_host.strip("[]") in LOOPBACK_NAMES or bind_host.startswith("127."):
        return list(LOOPBACK_NAMES)
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
        allowed_hosts: list[str] | None = None,
    ) -> None:
        self.app = app
        self.ctx = ctx
        self.digests = [_digest(k) for k in api_keys or []]
        self.hosts = None if allowed_hosts is None else {_host_name(h) for h in allowed_hosts}
        self.max_body = ctx.limits.max_request_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        host = _header(scope, b"host")
        if self.hosts is not None and host is not None and _host_name(host) not in self.hosts:
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
        receive = self._counting(receive)
        request_id = _client_request_id(scope) or random_id()
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)

    def _declared_too_large(self, scope) -> bool:
        length = _header(scope, b"content-length")
        return length is not None and length.strip().isdigit() and int(length) > self.max_body

    def _too_large_message(self) -> str:
        return f"The request body is larger than {self.max_body} bytes (--max-request-body-bytes)."

    def _counting(self, receive):
        """`receive` that fails the request (413) once the body passes the limit, for bodies
        without a Content-Length or with a false one; nothing beyond the limit is kept."""
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise APIError(413, self._too_large_message())
            return message

        return counted

    def _authorized(self, scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = _digest(token.strip())
        # compare against every key, so timing does not tell which one nearly matched
        return sum(hmac.compare_digest(digest, d) for d in self.digests) > 0


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
