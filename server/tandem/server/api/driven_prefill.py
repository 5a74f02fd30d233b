"""Decode-driven prefill -> decode behind a gateway (``docs/gateway.md``).

With no Tandem proxy in the data path, the gateway's picker (``tandem epp``) routes a request
to a decode engine and names the prefill engine in ``x-prefiller-host-port`` (llm-d's
convention), signed with the internal credential. The decode engine then does the proxy's
prefill step itself: it sends the prefill engine the request with ``max_tokens: 1`` and
``do_remote_decode`` (with the internal credential and the client's tenant, so both salt
their prefix caches alike), takes the signed handle from the answer, pulls the KV and
decodes. A header without the picker's signature is refused (403): a client can never aim an
engine at an address. When the prefill step fails, the engine serves the request whole.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from typing import Any

import httpx
from fastapi import Request

from tandem.server.wire.body import parsed_body
from tandem.server.wire.errors import APIError
from tandem.server.wire.prefill_step import prefill_request
from tandem.server.wire.tenancy import TENANT_HEADER, request_tenant
from tandem.server.wire.trust import PREFILLER_HEADER, PREFILLER_SIGNATURE_HEADER, prefiller_valid

from .state import ServerState

log = logging.getLogger("tandem.api")

PREFILL_TIMEOUT_S = 120.0


def named_prefiller(state: ServerState, request: Request) -> str | None:
    """The prefill engine's base URL the picker named for this request, None when none was;
    403 when the header is not the picker's (no or a wrong signature, or a malformed value)."""
    host_port = request.headers.get(PREFILLER_HEADER)
    if host_port is None:
        return None
    secret = state.settings.internal_api_key
    trusted = state.settings.credentials.open or (
        secret is not None
        and prefiller_valid(
            secret, host_port, request.headers.get(PREFILLER_SIGNATURE_HEADER), time.time()
        )
    )
    url = "http://" + host_port.strip()
    parts = urllib.parse.urlsplit(url)
    if not trusted or not parts.hostname or parts.path or "@" in parts.netloc:
        raise APIError(
            403,
            f"{PREFILLER_HEADER} is set by the gateway's endpoint picker only",
            code="prefiller_forbidden",
        )
    return url


async def prefill_remotely(
    state: ServerState, request: Request, prefiller: str
) -> dict[str, Any] | None:
    """The prefill engine's signed handle plus its URL (the decode request's
    ``kv_transfer_params``), or None when it handed none over: the request then runs whole
    here, as the proxy's flow falls back to aggregated."""
    body = parsed_body(request)
    if not isinstance(body, dict):
        return None
    headers = {}
    if state.settings.internal_api_key:
        headers["Authorization"] = f"Bearer {state.settings.internal_api_key}"
    if tenant := request_tenant(request):
        headers[TENANT_HEADER] = tenant
    try:
        async with httpx.AsyncClient(timeout=PREFILL_TIMEOUT_S) as client:
            r = await client.post(
                prefiller + request.url.path, json=prefill_request(body), headers=headers
            )
        kv = r.json().get("kv_transfer_params") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.warning("prefill on %s failed (%s); serving the request whole", prefiller, exc)
        return None
    if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
        log.warning(
            "prefill on %s answered %d without a handoff; serving it whole",
            prefiller,
            r.status_code,
        )
        return None
    return {**kv, "remote_engine_url": prefiller}
