"""A session's requests and blocks, on the engine holding the session: LMDeploy's abort and
``DELETE /v1/sessions/{id}``. The proxy knows which engine holds a session it routed (the
session table); for one it does not know, every engine that could hold it is asked."""

from __future__ import annotations

import asyncio
from typing import Annotated
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.edge import request_id_header
from tandem.server.wire.errors import APIError, error_response
from tandem.server.wire.protocol import ERROR_RESPONSES, AbortRequest, SessionId
from tandem.server.wire.tenancy import request_owner, session_key

from .bodies import client_body, json_body
from .registry import DECODE_ROLES
from .state import ProxyState, get_state

router = APIRouter(route_class=ParsedJSONRoute)


@router.post("/abort_request", responses=ERROR_RESPONSES)
async def abort_request(_: AbortRequest, request: Request) -> JSONResponse:
    """LMDeploy's abort: a session's requests on the engine holding the session (every
    decode engine if the proxy does not know it), or ``abort_all`` on every engine."""
    state = get_state(request)
    body = client_body(json_body(request), request)
    session = body.get("session_id")
    held = state.flow.sessions.get(str(session)) if session not in (None, "", -1) else None
    urls = (
        [held]
        if held and not body.get("abort_all")
        else [n.url for n in state.registry.nodes() if n.healthy]
    )
    headers = {**state.flow.headers, **request_id_header(request)}

    async def one(url: str) -> httpx.Response | None:
        try:
            return await state.client.post(
                url + "/abort_request", json=body, headers=headers, timeout=10.0
            )
        except httpx.HTTPError:
            return None

    answers = [r for r in await asyncio.gather(*(one(u) for u in urls)) if r is not None]
    refused = next((r for r in answers if r.status_code >= 400), None)
    if refused is not None:
        return JSONResponse(refused.json(), status_code=refused.status_code)
    return JSONResponse({"aborted": sum(int(r.json().get("aborted", 0)) for r in answers)})


@router.delete("/v1/sessions/{session_id}", responses=ERROR_RESPONSES)
async def delete_session(session_id: Annotated[SessionId, Path()], request: Request) -> Response:
    """Free a session's blocks on the engine holding it (every decode engine if unknown)."""
    state = get_state(request)
    session_id = session_key(session_id, request_owner(request)) or str(session_id)
    held = state.flow.sessions.get(session_id)
    urls = [held] if held else [n.url for n in state.registry.routable(DECODE_ROLES)]
    return await _delete_on(state, session_id, urls)


async def _delete_on(state: ProxyState, session_id: str, urls: list[str]) -> Response:
    """The first engine of ``urls`` that frees the session answers; a 404 only when every
    one answered that it does not hold it (one that did not answer may hold it: a 503)."""
    silent = ""
    for url in urls:
        try:
            r = await state.client.delete(
                f"{url}/v1/sessions/{quote(session_id, safe='')}",
                headers=state.flow.headers,
                timeout=10.0,
            )
        except httpx.HTTPError as exc:
            silent = f"{url}: {type(exc).__name__}"
            continue
        if r.status_code < 400:
            state.flow.sessions.forget(session_id)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
    if silent:
        raise APIError(
            503,
            f"an engine that may hold session {session_id!r} did not answer ({silent})",
            code="no_engine_available",
        )
    return error_response(
        APIError(
            404,
            f"session {session_id!r} does not exist",
            code="session_not_found",
            param="session_id",
        )
    )
