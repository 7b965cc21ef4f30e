"""The server's front door, as plain ASGI middleware (no `BaseHTTPMiddleware`, which would
hide the client's disconnect from the handlers and buffer streams).

In order: while draining (SIGTERM) everything but `/metrics` gets 503; `/v1` routes need
`Authorization: Bearer <key>` when API keys are set (compared as SHA-256 digests in constant
time; `/health`, `/metrics`, `/version`, `/tokenize` and CORS preflights stay open); every
request gets an id -- the client's `X-Request-Id` when it sends a usable one -- which the
handlers use as the base of the engine request id and which is echoed in the response.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re

from vserve.entrypoints.openai.errors import error_body
from vserve.entrypoints.openai.protocol import random_id
from vserve.entrypoints.openai.serving_base import ServerContext

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class FrontDoor:
    def __init__(self, app, ctx: ServerContext, api_keys: list[str] | None = None) -> None:
        self.app = app
        self.ctx = ctx
        self.digests = [_digest(k) for k in api_keys or []]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.ctx.draining and path not in ("/metrics", "/health"):
            await _send_json(send, 503, error_body(503, "The server is shutting down."),
                             [(b"retry-after", b"1")])
            return
        if self.digests and path.startswith("/v1") and scope["method"] != "OPTIONS" \
                and not self._authorized(scope):
            await _send_json(send, 401, error_body(401, "Unauthorized"),
                             [(b"www-authenticate", b"Bearer")])
            return
        request_id = _client_request_id(scope) or random_id()
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)

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
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
