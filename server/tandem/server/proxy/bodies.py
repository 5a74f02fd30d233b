"""The request bodies the proxy's routes read: parsed once at the edge (``JSONBodyGuard``),
and a client's generation request made safe to forward with the internal credential."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from tandem.server.wire.body import parsed_body
from tandem.server.wire.errors import APIError
from tandem.server.wire.tenancy import request_owner, session_key


def json_body(request: Request) -> dict[str, Any]:
    """The body ``JSONBodyGuard`` parsed (a copy: routes add fields), if it is an object."""
    body = parsed_body(request)
    if not isinstance(body, dict):
        raise APIError(
            400,
            "the request body must be a JSON object",
            code="invalid_value",
        )
    return dict(body)


def client_body(body: dict[str, Any], request: Request) -> dict[str, Any]:
    """A client's generation request, already validated against the engine's own model (the
    route's declared body): the P/D handoff field is the proxy's own, never theirs, and a
    session id is scoped to the client's key before it reaches an engine."""
    owner = request_owner(request)
    if owner and body.get("session_id") is not None:
        body = {**body, "session_id": session_key(body["session_id"], owner)}
    if "kv_transfer_params" in body:
        raise APIError(
            403,
            "kv_transfer_params belongs to the internal P/D plane and cannot be sent by clients",
            code="kv_transfer_forbidden",
            param="kv_transfer_params",
        )
    return body
