"""The gateway's API contract: the one error body of every refusal, and the error statuses each route documents.

FastAPI documents a route's success answer and its own request validation; the refusals the service answers
(:class:`nexus.errors.NexusError`, ``http_status``) come from code it cannot see. :data:`ERRORS` is the one table of
them: :func:`document` adds every row to every route that takes a bearer token (all but ``/health``), with the
:class:`ErrorBody` schema, so the OpenAPI document lists every status a client can meet. A status added here (a
429 with ``Retry-After``, say) is documented on every route at once; ``headers`` gives its response headers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

ERROR_SCHEMA = "ErrorBody"
BEARER = "HTTPBearer"  # the scheme FastAPI names after nexus.gateway.routes.common.bearer


class ErrorDetail(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    class_: str = Field(alias="class", description="the nexus.errors class, e.g. SpecError, NotFound")
    code: str = Field(description="a stable machine code, e.g. invalid, limit_exceeded, not_found")
    message: str = Field(description="what was refused and why (a bad value is quoted by a short prefix only)")


class ErrorBody(BaseModel):
    """Every refusal's body: ``{"error": {"class", "code", "message"}}``."""

    error: ErrorDetail


@dataclass(frozen=True)
class ErrorResponse:
    description: str
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # OpenAPI header objects by name


# status -> what it means; documented on every route that takes a token (nexus.errors: the classes behind them)
ERRORS: dict[int, ErrorResponse] = {
    401: ErrorResponse("Unauthorized: no bearer token, or one the service does not know"),
    403: ErrorResponse("Forbidden: the token does not cover this tenant, or the call needs the operator token"),
    404: ErrorResponse("NotFound: unknown tenant, job, version or file (another tenant's are unknown too)"),
    409: ErrorResponse("Conflict: the object's state forbids the call (a second training job, an existing name, "
                       "optim_step without forward_backward); JobFailed"),
    413: ErrorResponse("LimitExceeded: the request body is over max_request_bytes"),
    422: ErrorResponse("SpecError: an invalid spec, job, observation, batch or parameter (the message names the field, "
                       "what was expected and what came); LimitExceeded: over a quota (the limit and the value)"),
    501: ErrorResponse("NotSupported: an operation this service version does not offer"),
    503: ErrorResponse("Unavailable: the service, or the role the call needs, is unreachable or restarting; retry"),
}


# a route with a concurrency budget adds it: responses={429: OVERLOADED_RESPONSE}
OVERLOADED_RESPONSE: dict[str, Any] = {
    "description": "Overloaded: a concurrency budget is spent (the tenant's predicts, max_inflight_predicts, or "
                   "low-level calls, max_queued_ops; the gateway's predicts, qos.max_gateway_predicts); nothing "
                   "was done. Send again after Retry-After seconds (the body's retry_after_s is finer).",
    "headers": {"Retry-After": {"description": "seconds to wait before sending again",
                                "schema": {"type": "integer", "minimum": 1}}},
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["error", "retry_after_s"],
        "properties": {"error": {"type": "object", "properties": {
            "class": {"type": "string", "enum": ["Overloaded"]}, "code": {"type": "string", "enum": ["overloaded"]},
            "message": {"type": "string"}}}, "retry_after_s": {"type": "number"}}}}},
}


def document(app: FastAPI) -> None:
    """Make ``app.openapi()`` list :data:`ERRORS` (with :class:`ErrorBody`) on every route that takes a bearer
    token, in place of FastAPI's own validation-error schema (the gateway answers those with :class:`ErrorBody`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            add_errors(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_errors(doc: dict[str, Any]) -> None:
    """The error responses of :data:`ERRORS` added to every operation of an OpenAPI document with a security
    requirement; FastAPI's ``HTTPValidationError`` schemas dropped when nothing refers to them any more."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas[ERROR_SCHEMA] = ErrorBody.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    schemas.update(schemas[ERROR_SCHEMA].pop("$defs", {}))
    ref = {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            if not isinstance(op, dict) or not op.get("security"):
                continue
            responses = op.setdefault("responses", {})
            for status, err in ERRORS.items():
                entry: dict[str, Any] = {"description": err.description,
                                         "content": {"application/json": {"schema": ref}}}
                if err.headers:
                    entry["headers"] = err.headers
                responses[str(status)] = entry
    text = str(doc.get("paths", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        if f"schemas/{name}'" not in text:
            schemas.pop(name, None)


def relative_paths(data: Any, own_dir: str, root: str) -> Any:
    """What a tenant sees of an answer: every path inside its own output dir relative to it (the dir itself is
    "."), and the service's root never in full (``<root>``): a tenant learns nothing of the server's file system."""
    own, root = own_dir.rstrip("/"), root.rstrip("/")

    def scrub(x: Any) -> Any:
        if isinstance(x, str):
            if x == own:
                return "."
            x = x.replace(own + "/", "").replace(own, ".")
            return x.replace(root, "<root>") if root else x
        if isinstance(x, dict):
            return {k: scrub(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [scrub(v) for v in x]
        return x

    return scrub(data)
