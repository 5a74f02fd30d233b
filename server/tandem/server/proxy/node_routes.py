"""LMDeploy's node registry routes: engines join (``/nodes/add``, as ``tandem serve
--proxy-url`` does), leave, are listed with their health and load, and are terminated."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Request
from pydantic import Field

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import ERROR_RESPONSES, APIModel
from tandem.server.wire.roles import parse_role

from .bodies import json_body
from .registry import UNREACHABLE, normalize_url
from .state import ProxyState, get_state

router = APIRouter(route_class=ParsedJSONRoute)


class NodeStatusBody(APIModel):
    """LMDeploy's ``status`` of a node: its role and the models it serves (more is kept)."""

    role: str | int | None = None  # a name, or LMDeploy's number
    models: list[str] | None = None


class NodeBody(APIModel):
    """``/nodes/add``, ``/nodes/remove``, ``/nodes/terminate``: LMDeploy's node request."""

    url: Annotated[str, Field(min_length=1, max_length=2048)]  # "host:port" means http://
    status: NodeStatusBody | None = None
    models: list[str] | None = None


def _node_fields(body: dict[str, Any]) -> tuple[str, str, list[str] | None]:
    """The node a request names: its URL (normalized), role and models; a 400 naming the
    field that is wrong. Role and models are read from ``status`` or, as LMDeploy also
    accepts, from the body itself."""
    url = body.get("url")
    if not isinstance(url, str) or not url.strip():
        raise APIError(
            400,
            "'url' is a required property",
            code="invalid_value",
            param="url",
        )
    status = body.get("status") or {}
    if not isinstance(status, dict):
        raise APIError(
            400,
            "'status' must be an object",
            code="invalid_value",
            param="status",
        )
    role = status.get("role", body.get("role"))
    try:
        role_name = parse_role(role)
    except ValueError as exc:
        raise APIError(
            400,
            str(exc),
            code="invalid_value",
            param="status.role",
        ) from exc
    models = status.get("models", body.get("models"))
    if models is not None and not (
        isinstance(models, list) and all(isinstance(m, str) for m in models)
    ):
        raise APIError(
            400,
            "'models' must be a list of strings",
            code="invalid_value",
            param="status.models",
        )
    try:
        return normalize_url(url), role_name, models
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="url") from exc


@router.post("/nodes/add", responses=ERROR_RESPONSES)
async def add_node(_: NodeBody, request: Request) -> dict[str, Any]:
    """Add (or update) an engine; it takes requests once its ``/health`` answers 200."""
    state = get_state(request)
    body = json_body(request)
    url, role, models = _node_fields(body)
    try:
        await state.settings.node_networks.check_url(url)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="url") from exc
    layout = (body.get("status") or {}).get("kv_layout")  # Tandem's addition, optional
    node = state.registry.add(
        url, role, models, source="registered", kv_layout=str(layout) if layout else None
    )
    await state.poller.probe(url)
    return {
        "url": node.url,
        "role": node.role_id,
        "role_name": node.role,
        "healthy": node.healthy,
    }


@router.post("/nodes/remove", responses=ERROR_RESPONSES)
async def remove_node(_: NodeBody, request: Request) -> dict[str, Any]:
    state = get_state(request)
    url, _, _ = _node_fields({"status": {}, **(json_body(request))})
    node = state.registry.remove(url)
    return {"url": url, "removed": node is not None}


@router.get("/nodes/status")
async def node_status(request: Request) -> dict[str, Any]:
    """``{url: status}`` as LMDeploy's proxy answers, with health and load added."""
    return {n.url: n.status() for n in get_state(request).registry.nodes()}


async def _terminate(state: ProxyState, url: str) -> dict[str, Any]:
    """Only a registered engine that proved it holds the credential, and only its status
    is reported: the proxy fetches no address a caller names and echoes nothing it read
    (no SSRF, no port scan)."""
    node = state.registry.remove(url)
    if node is None:
        raise APIError(
            404,
            f"{url} is not a registered engine",
            code="node_not_found",
            param="url",
        )
    if not node.verified:  # it never proved it holds the credential: it gets none
        return {"url": url, "was_registered": True, "terminated": False, "detail": UNREACHABLE}
    try:
        r = await state.client.get(url + "/terminate", headers=state.flow.headers, timeout=10.0)
        ok, detail = r.status_code < 400, f"HTTP {r.status_code}"
    except httpx.HTTPError:
        ok, detail = False, UNREACHABLE
    return {"url": url, "was_registered": True, "terminated": ok, "detail": detail}


@router.post("/nodes/terminate", responses=ERROR_RESPONSES)
async def terminate_node(_: NodeBody, request: Request) -> dict[str, Any]:
    """Stop one engine (its ``/terminate``: drain, then exit) and drop it."""
    state = get_state(request)
    url, _, _ = _node_fields({"status": {}, **(json_body(request))})
    return await _terminate(state, url)


@router.api_route("/nodes/terminate_all", methods=["GET", "POST"])
async def terminate_all(request: Request) -> dict[str, Any]:
    state = get_state(request)
    results = await asyncio.gather(*(_terminate(state, n.url) for n in state.registry.nodes()))
    return {"terminated": list(results)}
