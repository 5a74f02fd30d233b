"""Whose a request is: the session ids and prefix-cache partitions the engine and the proxy
scope by the caller's key (the auth middleware sets ``request.state.owner``/``tenant``).

The proxy forwards with the internal credential, so it scopes a client's session ids and
names the client's tenant (``X-Tandem-Tenant``) the same way the engine would for a client
calling it directly.
"""

from __future__ import annotations

from fastapi import Request

_OWNER_LEN = 16  # auth.key_owner's hex digest length


def session_key(value: str | int | None, owner: str | None = None) -> str | None:
    """The engine's session id: ``None``, ``""`` and ``-1`` (LMDeploy's "no session") are stateless.

    A session belongs to the client key that created it (``owner``, set by the auth
    middleware): another key naming the same id reaches a different session. The proxy
    scopes ids the same way before it forwards them with the internal credential."""
    if value is None or value == "" or value == -1:
        return None
    return f"{owner}:{value}" if owner else str(value)


def same_session(key: str, wanted: str, owner: str | None) -> bool:
    """Whether engine session ``key`` is ``wanted`` as this caller names it: a client names
    its own sessions; the admin and internal callers (no owner) name any client's."""
    if key == wanted:
        return True
    scope, sep, rest = key.partition(":")
    return owner is None and bool(sep) and len(scope) == _OWNER_LEN and rest == wanted


def request_owner(request: Request) -> str | None:
    return getattr(request.state, "owner", None)


TENANT_HEADER = "x-tandem-tenant"
_MAX_TENANT_LEN = 64


def request_tenant(request: Request) -> str | None:
    """Whose prefix-cache partition a request runs in: its client (or admin) key's owner
    name (set by the auth middleware). The proxy forwards its caller's in ``X-Tandem-Tenant``
    with the internal credential, so the header counts only from an internal caller (or on an
    open server, where there is nobody to tell apart). Keyless callers share one (``None``)."""
    principal = getattr(request.state, "principal", "open")
    if principal in ("internal", "open"):
        return request.headers.get(TENANT_HEADER, "")[:_MAX_TENANT_LEN] or None
    return getattr(request.state, "tenant", None)
