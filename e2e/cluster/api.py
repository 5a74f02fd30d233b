"""A minimal HTTPS client for the harness's own readiness checks.

The harness must work before kubectl is installed and without any pip
package, so it talks to the API server with urllib and the admin client
certificate. Tests use kubectl; this is only for bring-up.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

from e2e.cluster.pki import CertPair


class ApiError(Exception):
    """Non-2xx answer from the API server (status and body kept for diagnosis)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


class Api:
    """Admin-authenticated JSON requests against one API server."""

    def __init__(self, server: str, ca: CertPair, client: CertPair) -> None:
        self._server = server.rstrip("/")
        self._ctx = ssl.create_default_context(cafile=str(ca.cert))
        self._ctx.load_cert_chain(str(client.cert), str(client.key))

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> str:
        """Send one request and return the body text; raises ApiError on non-2xx."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self._server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=timeout) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as err:
            raise ApiError(err.code, err.read().decode(errors="replace")) from None

    def get_json(self, path: str) -> dict[str, Any]:
        """GET and decode a JSON object."""
        return json.loads(self.request("GET", path))

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST an object; an AlreadyExists conflict is fine (idempotent bring-up)."""
        try:
            return json.loads(self.request("POST", path, body))
        except ApiError as err:
            if err.status == 409:
                return body
            raise
