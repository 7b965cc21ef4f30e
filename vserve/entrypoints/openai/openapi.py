"""The OpenAPI document (`/openapi.json`) describes every request body, so that generic
clients and fuzzers (schemathesis) can drive the API.

The handlers parse their bodies themselves (`errors.parse_body`: OpenAI-style 400s, NaN
refused, depth-limited), so FastAPI does not see the body models; each POST route declares
its model with `body_doc(Model)`, and `document_bodies` adds the models' JSON schemas to the
document's components.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from vserve.entrypoints.openai.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"


def body_doc(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body is `model`; errors are OpenAI-style."""
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(
        model=ErrorResponse.__name__)}}}}
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}},
        "responses": {str(status): {"description": description, **error}
                      for status, description in ((400, "Invalid request"),
                                                  (413, "Request body too large"),
                                                  (503, "Overloaded or shutting down"))}}


def document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` include the schemas of `models` (and what they reference)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in [*models, ErrorResponse]],
                                         ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
