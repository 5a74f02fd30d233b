"""Operations: ``/health`` (ready when some engine can decode) and Prometheus ``/metrics``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.protocol import METRICS_RESPONSES
from tandem.server.wire.roles import ROLE_IDS

from .metrics import CONTENT_TYPE, ProxyCollector
from .registry import DECODE_ROLES
from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when some decode or aggregated engine can take requests, else 503."""
    state = get_state(request)
    nodes = state.registry.nodes()
    by_role = {role: sum(1 for n in nodes if n.healthy and n.role == role) for role in ROLE_IDS}
    ready = any(n.healthy and n.role in DECODE_ROLES for n in nodes)
    body = {
        "status": "ok" if ready else "no_engines",
        "nodes": len(nodes),
        "healthy_nodes": by_role,
        "uptime_seconds": round(time.time() - state.started_at, 3),
        "in_flight": sum(n.inflight for n in nodes),
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
async def metrics(request: Request) -> Response:
    """Prometheus text: requests by route/mode/status, failures, fallbacks, nodes."""
    reg = CollectorRegistry()
    reg.register(ProxyCollector(get_state(request)))
    return Response(generate_latest(reg), media_type=CONTENT_TYPE)
