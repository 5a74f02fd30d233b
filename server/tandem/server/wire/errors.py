"""One error shape for every route: OpenAI's ``{"error": {"message", "type", "code", "param"}}``.

Clients (the OpenAI SDK, LangChain) parse this shape to raise typed exceptions, so FastAPI's
default 422 ``{"detail": [...]}`` body is replaced: validation problems are 400s here, and
nothing a client sends may surface as a 500.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Send

log = logging.getLogger("tandem.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_disconnected",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a route answers with; carries everything the OpenAI error body needs."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.retry_after = retry_after  # seconds, sent as Retry-After

    def body(self) -> dict[str, Any]:
        return error_body(
            self.status, self.message, code=self.code, param=self.param, type=self.type
        )


class ClientDisconnected(APIError):
    """The client went away before its response was ready (nobody reads the 499)."""

    def __init__(self) -> None:
        super().__init__(499, "client disconnected")


def error_body(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    type: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "invalid_request_error"),
            "code": code,
            "param": param,
        }
    }


def _count(request: Request, status: int) -> None:
    state = getattr(request.app.state, "tandem", None)
    if state is not None:
        state.metrics.on_error(status)


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    if err.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    if err.retry_after is not None:
        headers = {**(headers or {}), "Retry-After": str(err.retry_after)}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def send_error(send: Send, err: APIError) -> None:
    """The same response as ``error_response``, from pure ASGI middleware."""
    response = error_response(err)
    await send(
        {"type": "http.response.start", "status": err.status, "headers": response.raw_headers}
    )
    await send({"type": "http.response.body", "body": response.body})


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """The request field a pydantic error location names, without ``body`` and without the
    union-branch tags pydantic adds (``constrained-str``, ``list[str]``, ``function-after``)."""
    return [
        str(p)
        for p in loc
        if p != "body"
        and (isinstance(p, int) or (p.isidentifier() and p.lower() not in _UNION_TAGS))
    ]


def validation_message(exc: Any) -> tuple[str, str | None]:
    """A one-line message and the offending field (dotted). Of a union's errors, the one that
    says what is wrong with the value (too long, not finite) wins over "not a string"."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0])
    loc = _field_path(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        msg = f"'{param}' is a required property" if param else "a required property is missing"
    elif param:
        msg = f"{param}: {msg}"
    more = len(errors) - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return msg, param


def without_422(app: FastAPI) -> None:
    """FastAPI documents a 422 on every route with a body; ours answer 400 instead (above).

    It also gives a route serving several methods one operation id for all of them; each
    operation here gets its own (its method's suffix), as OpenAPI requires."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                ids = [op.get("operationId") for op in item.values()]
                for method, op in item.items():
                    op.get("responses", {}).pop("422", None)
                    if ids.count(op.get("operationId")) > 1:
                        stem = re.sub(r"_[a-z]+$", "", op["operationId"])
                        op["operationId"] = f"{stem}_{method}"
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method the routes on this path take (Starlette's 405 names only the first
    route's, and ``GET``/``DELETE /v1/responses/{id}`` are two routes)."""
    routes = request.app.router.routes
    return [
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] == Match.FULL for r in routes)
    ]


def install_error_handlers(app: FastAPI) -> None:
    without_422(app)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count(request, exc.status)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count(request, 400)
        message, param = validation_message(exc)
        return error_response(APIError(400, message, code="invalid_value", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        _count(request, exc.status_code)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code
        )
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
        return error_response(APIError(exc.status_code, str(exc.detail), code=code), headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        _count(request, 500)
        return error_response(
            APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        )
