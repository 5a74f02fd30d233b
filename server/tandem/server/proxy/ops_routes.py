"""Operations: ``/health`` (ready when some engine can decode; the model and the engines'
KV block pools summed), Prometheus ``/metrics`` and ``/v1/gpu/info`` (every engine's GPUs)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.protocol import METRICS_RESPONSES
from tandem.server.wire.roles import ROLE_IDS

from .metrics import CONTENT_TYPE, ProxyCollector
from .registry import DECODE_ROLES, Node
from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when some decode or aggregated engine can take requests, else 503."""
    state = get_state(request)
    nodes = state.registry.nodes()
    by_role = {role: sum(1 for n in nodes if n.healthy and n.role == role) for role in ROLE_IDS}
    ready = any(n.healthy and n.role in DECODE_ROLES for n in nodes)
    models = state.registry.models()
    body = {
        "status": "ok" if ready else "no_engines",
        "model": models[0] if len(models) == 1 else None,
        "models": models,
        "nodes": len(nodes),
        "healthy_nodes": by_role,
        "uptime_seconds": round(time.time() - state.started_at, 3),
        "in_flight": sum(n.inflight for n in nodes),
        "block_pool": _block_pool([n for n in nodes if n.healthy]),
    }
    return JSONResponse(body, status_code=200 if ready else 503)


def _block_pool(nodes: list[Node]) -> dict[str, Any]:
    """The healthy engines' KV block pools as one (their last /health answers), in the
    engine's own ``block_pool`` shape."""
    total = sum(n.total_blocks or 0 for n in nodes)
    free = sum(n.free_blocks or 0 for n in nodes)
    return {
        "total_blocks": total,
        "free_blocks": free,
        "utilization": round(1 - free / total, 6) if total else 0.0,
    }


@router.get("/v1/gpu/info")
async def gpu_info(request: Request) -> dict[str, Any]:
    """Every healthy engine's ``/v1/gpu/info``, asked now: ``gpus`` (each with its engine's
    ``engine`` URL) and per engine its answer or the error that stood in its place."""
    state = get_state(request)

    async def one(node: Node) -> dict[str, Any]:
        try:
            r = await state.client.get(
                node.url + "/v1/gpu/info", headers=state.flow.headers, timeout=10.0
            )
            gpus = r.json().get("gpus", []) if r.status_code == 200 else []
            error = None if r.status_code == 200 else f"answered {r.status_code}"
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            gpus, error = [], type(exc).__name__
        return {"url": node.url, "role": node.role, "gpus": gpus, "error": error}

    engines = await asyncio.gather(*(one(n) for n in state.registry.nodes() if n.healthy))
    gpus = [{**g, "engine": e["url"]} for e in engines for g in e["gpus"]]
    return {"gpus": gpus, "engines": list(engines)}


@router.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
async def metrics(request: Request) -> Response:
    """Prometheus text: requests by route/mode/status, failures, fallbacks, nodes."""
    reg = CollectorRegistry()
    reg.register(ProxyCollector(get_state(request)))
    return Response(generate_latest(reg), media_type=CONTENT_TYPE)
