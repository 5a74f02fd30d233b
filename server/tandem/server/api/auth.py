"""Bearer-token auth as pure ASGI middleware (so streaming and disconnect detection are untouched).

With an API key set, every route but the probes (``/health``, ``/metrics``) needs
``Authorization: Bearer KEY``; anything else is a 401 in the OpenAI error shape.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in OPEN_PATHS
            or scope.get("method") == "OPTIONS"
        ):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given.strip(), self._expected):
            await self.app(scope, receive, send)
            return
        message = (
            "Missing API key: send 'Authorization: Bearer <key>'"
            if not given
            else "Incorrect API key provided"
        )
        body = json.dumps(error_body(401, message, code="invalid_api_key")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
