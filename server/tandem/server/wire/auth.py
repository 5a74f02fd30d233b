"""Who may call what: three credentials, checked by pure ASGI middleware (so streaming and
disconnect detection are untouched). ``docs/security.md`` has the whole trust model.

- **client** keys (several allowed): the OpenAI and native generation routes;
- the **internal** credential, shared by a proxy and its engines: everything a client may do,
  plus the P/D handoff (``kv_transfer_params``), ``/distserve/*`` and the admin routes the
  proxy calls on engines;
- the **admin** key: the admin routes (``/terminate``, ``/sleep``, the proxy's ``/nodes/*``...).

A client key is never enough for an admin route (403). With no credential configured at
all the server is open (a laptop or a test). With ``keyless_clients`` (a server that has no
client key but guards its admin or internal routes: a proxy without ``--api-key``, an engine
with only an admin key) a caller without one of our keys is an anonymous client: it may do
what a client may do and nothing more. Otherwise every route but the probes (``/health``,
``/metrics``) needs a key.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, send_error

OPEN_PATHS = frozenset({"/health", "/metrics"})
# Engine routes that administer the server or the P/D plane, never a client's business.
ENGINE_ADMIN_PATHS = frozenset(
    {
        "/terminate",
        "/sleep",
        "/wakeup",
        "/pause",
        "/resume",
        "/update_weights",
        "/abort_request",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)
ENGINE_ADMIN_PREFIXES = ("/distserve/",)
PROXY_ADMIN_PATHS: frozenset[str] = frozenset({"/abort_request", "/update_weights"})
PROXY_ADMIN_PREFIXES = ("/nodes/", "/distserve/")

Principal = Literal["open", "anonymous", "client", "internal", "admin"]


@dataclass(frozen=True)
class Credentials:
    """The keys one server accepts, validated once at start-up."""

    client_keys: frozenset[str] = frozenset()
    internal_key: str | None = None
    admin_key: str | None = None
    keyless_clients: bool = False

    def __post_init__(self) -> None:
        roles = [set(self.client_keys), {self.internal_key} - {None}, {self.admin_key} - {None}]
        if any(a & b for i, a in enumerate(roles) for b in roles[i + 1 :]):
            raise ValueError("client, internal and admin keys must all differ")
        if "" in self.client_keys or self.internal_key == "" or self.admin_key == "":
            raise ValueError("an API key must not be empty")

    @property
    def open(self) -> bool:
        return not (self.client_keys or self.internal_key or self.admin_key)

    def principal(self, authorization: bytes) -> Principal | None:
        """Whose key the ``Authorization`` header carries (None: none of ours, and keyless
        callers are not served)."""
        if self.open:
            return "open"
        who = self._key_holder(authorization)
        if who is None and self.keyless_clients and not self.client_keys:
            return "anonymous"
        return who

    def _key_holder(self, authorization: bytes) -> Principal | None:
        scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        token = token.strip()
        if self.admin_key and hmac.compare_digest(token, self.admin_key):
            return "admin"
        if self.internal_key and hmac.compare_digest(token, self.internal_key):
            return "internal"
        # Compare against every client key so timing says nothing about which one matched.
        matched = False
        for key in self.client_keys:
            matched |= hmac.compare_digest(token, key)
        return "client" if matched else None


def key_owner(authorization: bytes) -> str:
    """A client key's stable, non-secret name: what its sessions are scoped to."""
    token = authorization.decode("latin-1").strip().partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def read_keys(path: str | os.PathLike[str]) -> list[str]:
    """A key file: one key per line; blank lines and ``#`` comments ignored."""
    lines = Path(path).read_text().splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def key_from(value: str | None, file: str | None) -> str | None:
    """One key from a flag/env value or a file holding it (the first key in the file)."""
    if value:
        return value
    if file:
        keys = read_keys(file)
        if not keys:
            raise ValueError(f"{file} holds no key")
        return keys[0]
    return None


def load_credentials(
    *,
    client_keys: Iterable[str | None] = (),
    client_key_file: str | None = None,
    internal_key: str | None = None,
    internal_key_file: str | None = None,
    admin_key: str | None = None,
    admin_key_file: str | None = None,
) -> Credentials:
    """Credentials from flag or environment values and key files."""
    clients = {k for k in client_keys if k}
    if client_key_file:
        clients.update(read_keys(client_key_file))
    return Credentials(
        frozenset(clients),
        key_from(internal_key, internal_key_file),
        key_from(admin_key, admin_key_file),
    )


def env_credentials(
    environ: Mapping[str, str], client_env: str, **given: str | None
) -> Credentials:
    """Flags first, then the environment: ``<client_env>`` / ``<client_env>_FILE`` for client
    keys, ``TANDEM_INTERNAL_API_KEY[_FILE]`` and ``TANDEM_ADMIN_API_KEY[_FILE]``."""
    return load_credentials(
        client_keys=[given.get("client_key") or environ.get(client_env)],
        client_key_file=given.get("client_key_file") or environ.get(client_env + "_FILE"),
        internal_key=given.get("internal_key") or environ.get("TANDEM_INTERNAL_API_KEY"),
        internal_key_file=given.get("internal_key_file")
        or environ.get("TANDEM_INTERNAL_API_KEY_FILE"),
        admin_key=given.get("admin_key") or environ.get("TANDEM_ADMIN_API_KEY"),
        admin_key_file=given.get("admin_key_file") or environ.get("TANDEM_ADMIN_API_KEY_FILE"),
    )


def add_credential_arguments(parser: argparse.ArgumentParser, client_env: str) -> None:
    """The key-file, internal and admin flags ``tandem serve`` and ``tandem proxy`` share
    (each has its own ``--api-key``)."""
    parser.add_argument(
        "--api-key-file",
        default=None,
        help=f"client keys, one per line (default: ${client_env}_FILE)",
    )
    parser.add_argument(
        "--internal-api-key",
        default=None,
        help="the credential the proxy and its engines share: P/D handoff, /distserve/*, admin "
        "routes (default: $TANDEM_INTERNAL_API_KEY; prefer it: arguments show in ps)",
    )
    parser.add_argument(
        "--internal-api-key-file",
        default=None,
        help="a file holding the internal credential (default: $TANDEM_INTERNAL_API_KEY_FILE)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=None,
        help="the key for the admin routes (docs/security.md) (default: $TANDEM_ADMIN_API_KEY)",
    )
    parser.add_argument(
        "--admin-api-key-file",
        default=None,
        help="a file holding the admin key (default: $TANDEM_ADMIN_API_KEY_FILE)",
    )


def credentials_from_args(
    args: argparse.Namespace, environ: Mapping[str, str], client_env: str
) -> Credentials:
    """What ``add_credential_arguments`` and ``--api-key`` configure, the environment filling in."""
    return env_credentials(
        environ,
        client_env,
        client_key=args.api_key,
        client_key_file=args.api_key_file,
        internal_key=args.internal_api_key,
        internal_key_file=args.internal_api_key_file,
        admin_key=args.admin_api_key,
        admin_key_file=args.admin_api_key_file,
    )


def presented_key(headers: Mapping[bytes, bytes]) -> bytes:
    """The ``Authorization`` header, or Anthropic's ``x-api-key`` as its bearer token (what
    the ``anthropic`` SDK and tools pointed at ``ANTHROPIC_BASE_URL`` send)."""
    if authorization := headers.get(b"authorization"):
        return authorization
    key = headers.get(b"x-api-key", b"").strip()
    return b"Bearer " + key if key else b""


def is_admin_path(path: str, paths: frozenset[str], prefixes: tuple[str, ...]) -> bool:
    return path in paths or path.startswith(prefixes)


class AuthMiddleware:
    """Checks the credential against the route's plane and records who called on
    ``scope["state"]["principal"]`` (``request.state.principal``) for finer checks."""

    def __init__(
        self,
        app: ASGIApp,
        credentials: Credentials,
        admin_paths: frozenset[str] = ENGINE_ADMIN_PATHS,
        admin_prefixes: tuple[str, ...] = ENGINE_ADMIN_PREFIXES,
    ) -> None:
        self.app = app
        self.credentials = credentials
        self.admin_paths = admin_paths
        self.admin_prefixes = admin_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = presented_key(dict(scope.get("headers") or ()))
        who = self.credentials.principal(given)
        state = scope.setdefault("state", {})
        state["principal"] = who
        if who == "client":
            state["owner"] = key_owner(given)
        if who in ("client", "admin"):
            state["tenant"] = key_owner(given)  # its own prefix-cache partition
        path = scope["path"]
        if who == "open" or path in OPEN_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        denied = who is None or (
            who in ("anonymous", "client")
            and is_admin_path(path, self.admin_paths, self.admin_prefixes)
        )
        if denied and _method_not_allowed(scope):  # the router's 405 with Allow, whoever calls
            await self.app(scope, receive, send)
            return
        if who is None:
            message = (
                "Missing API key: send 'Authorization: Bearer <key>'"
                if not given
                else "Incorrect API key provided"
            )
            await _deny(send, 401, message, "invalid_api_key")
            return
        if who == "anonymous" and is_admin_path(path, self.admin_paths, self.admin_prefixes):
            await _deny(
                send, 401, f"{path} is an admin route: send the admin key", "invalid_api_key"
            )
            return
        if who == "client" and is_admin_path(path, self.admin_paths, self.admin_prefixes):
            await _deny(
                send, 403, f"{path} is an admin route: a client key cannot call it", "forbidden"
            )
            return
        await self.app(scope, receive, send)


def _method_not_allowed(scope: Scope) -> bool:
    """Whether a route has this path but not this method (``TRACE /pause``): a 405 names
    the methods a route takes, which its OpenAPI already says, so it need not wait for the
    credential check; an admin route's 401/403 is kept for the methods it has."""
    app = scope.get("app")
    routes = getattr(getattr(app, "router", None), "routes", ())
    partial = False
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return False
        partial = partial or match == Match.PARTIAL
    return partial


async def _deny(send: Send, status: int, message: str, code: str) -> None:
    await send_error(send, APIError(status, message, code=code))
