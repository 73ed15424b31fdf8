"""The OpenAPI document says what the server does: each operation lists the error statuses it
can answer, all with the OpenAI-shaped error body, and nothing it cannot.

FastAPI documents a 422 validation error on every operation with inputs; this server answers
validation errors with a 400 (as OpenAI does), so `openapi_without_validation_422` drops the
422s that no route declared itself, and the validation schemas only they used.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.response_schemas import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "Malformed or unsupported input, a Host header not served here, or a prompt that "
    "does not fit the model's context or the KV cap",
    401: "Missing or incorrect API key",
    404: "No such session",
    409: "The session has a request in flight",
    413: "Request body too large",
    422: "Pin rules or a policy override that cannot be applied",
    429: "Too many requests waiting for the model (see Retry-After)",
    503: "The request waited too long for the model (see Retry-After)",
}


def error_responses(*statuses: int) -> dict:
    """FastAPI `responses` entries for error `statuses`, each with the error body."""
    return {
        status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        for status in statuses
    }


def openapi_without_validation_422(app: FastAPI) -> Callable[[], dict]:
    """An `app.openapi` replacement: FastAPI's document, cached, minus the 422 responses the
    routes did not declare (and the validation-error schemas left unused)."""

    def build() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path_item in doc.get("paths", {}).values():
            for operation in path_item.values():
                response = operation.get("responses", {}).get("422")
                if response is not None and "HTTPValidationError" in str(response):
                    del operation["responses"]["422"]
        schemas = doc.get("components", {}).get("schemas", {})
        if "HTTPValidationError" not in str(doc.get("paths")):
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
        app.openapi_schema = doc
        return doc

    return build
