"""OpenAI-style errors: `APIError` (an HTTP status and a message), the error body
`{"error": {"message", "type", "param", "code"}}`, and request-body parsing that answers 400
for malformed JSON, a wrong content type or invalid fields (never FastAPI's 422)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from vserve.engine.mp_client import EngineDeadError
from vserve.entrypoints.openai.api_error import APIError

logger = logging.getLogger("vserve.server")

# `type` of the error body: the `openai` client's exception class for the status, as vLLM
# names them; other statuses get their HTTP reason phrase (as vLLM's HTTPException handler)
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "APIError"


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_status(exc: BaseException) -> tuple[int, str]:
    """HTTP status and message for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, EngineDeadError):
        lines = [line for line in str(exc).splitlines() if line.strip()] or ["unknown cause"]
        cause = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # no traceback
        return 500, f"The engine is dead: {cause}"
    # the details go to the server's log, never to the client
    return 500, "Internal server error; the server's log has the details."


Req = TypeVar("Req", bound=BaseModel)

# '{', '[' and ':' bytes a body may hold outside its strings (objects, arrays, keys): parsing
# and validating cost time and memory per JSON value, and this bounds them before either
# starts (2.5 million chat messages: 10 s of validation, 700 MB)
MAX_BODY_STRUCTURE = 1 << 17
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"{[:')  # every other byte
_STRING = re.compile(rb'"[^"]*"')  # a string, once its escapes are gone


async def parse_body(
    raw: Request, model: type[Req], on_ignored: Callable[[int], None] | None = None
) -> Req:
    """JSON body -> request model; 400 (never FastAPI's 422) for anything malformed. Decoding
    and validation run on a worker thread; unknown top-level fields are dropped, counted
    (`on_ignored`) and logged at DEBUG."""
    media = raw.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")
    try:
        body = await raw.body()
        req, ignored = await asyncio.to_thread(parse_json_body, body, model)
    finally:
        budget = getattr(raw.state, "body_budget", None)
        if budget is not None:  # parsed (or refused): its bytes no longer pend
            budget.release()
    if ignored:
        if on_ignored is not None:
            on_ignored(len(ignored))
        if logger.isEnabledFor(logging.DEBUG):
            names = ", ".join(repr(name[:40]) for name in ignored[:10])
            more = f" and {len(ignored) - 10} more" if len(ignored) > 10 else ""
            logger.debug("ignored %d unknown request field(s): %s%s", len(ignored), names, more)
    return req


def parse_json_body(body: bytes, model: type[Req]) -> tuple[Req, list[str]]:
    """The request model of a JSON body, and the unknown top-level fields it dropped."""
    if _structure(body) > MAX_BODY_STRUCTURE:
        raise APIError(
            400,
            f"The request body has more than {MAX_BODY_STRUCTURE} JSON objects, arrays and "
            "keys in all.",
        )
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        data = _explain_decode_error(body, e)
    except RecursionError:
        raise APIError(400, "Invalid JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object")
    known = _field_names(model)
    ignored = [key for key in data if key not in known]
    for key in ignored:
        del data[key]
    try:
        return model.model_validate(data), ignored
    except ValidationError as e:
        raise validation_error(e) from e
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply") from None


def _structure(body: bytes) -> int:
    """Objects, arrays and keys of a JSON body: its '{', '[' and ':' outside strings. Only a
    body over the limit counting those in strings too is looked at again, and only when at
    most 4 times over it (more is no request a client means): escapes
    removed, every byte but those four and quotes dropped, then the strings (C-speed steps)."""
    count = body.count(b"{") + body.count(b"[") + body.count(b":")
    if count <= MAX_BODY_STRUCTURE or count > 4 * MAX_BODY_STRUCTURE:
        return count
    bare = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    outside = _STRING.sub(b"", bare)
    return outside.count(b"{") + outside.count(b"[") + outside.count(b":")


def _explain_decode_error(body: bytes, error: msgspec.DecodeError):
    """What msgspec refused, said as Python's parser sees it (bounded by the structure count
    above): its message for malformed JSON, NaN and Infinity; a lone surrogate is refused
    here; numbers beyond 64 bits go on as Python reads them, to be refused by the field's
    own check (which names the field)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "Invalid JSON body: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN or Infinity
        raise APIError(400, f"Invalid JSON body: {e}") from None
    if "out of range" not in str(error):
        raise APIError(
            400, f"Invalid JSON body: {error} (a string with a lone surrogate is not Unicode)"
        )
    return data


def _no_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity; JSON (and OpenAI) does not
    raise ValueError(f"{name} is not valid JSON")


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    names = set(model.model_fields)
    names.update(f.alias for f in model.model_fields.values() if f.alias)
    return frozenset(names)


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors()
    parts = []
    for err in errors[:3]:  # unions (prompt) report one error per alternative
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
    return APIError(400, "; ".join(parts), param)
