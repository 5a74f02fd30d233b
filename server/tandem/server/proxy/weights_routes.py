"""``/update_weights`` through the proxy: every engine serving the model loads the new
weights at once, each by its own policy for the requests it has in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.edge import request_id_header
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import ERROR_RESPONSES, UpdateWeightsRequest

from .bodies import json_body
from .state import ProxyState, get_state

router = APIRouter(route_class=ParsedJSONRoute)


@router.post("/update_weights", responses=ERROR_RESPONSES)
async def update_weights(_: UpdateWeightsRequest, request: Request) -> JSONResponse:
    """Every healthy engine serving ``model`` (every engine without one) loads the weights,
    all at once, each by its own policy for requests in flight; the answer lists each
    engine's. If any engine refused, the first refusal is the answer (its status and
    error), with the list beside it."""
    state = get_state(request)
    body = json_body(request)
    model = body.get("model")
    urls = [n.url for n in state.registry.nodes() if n.healthy and n.serves(model)]
    if not urls and not any(n.serves(model) for n in state.registry.nodes()):
        raise APIError(  # the caller's mistake, not an outage
            404, f"The model '{model}' does not exist", code="model_not_found", param="model"
        )
    if not urls:
        raise APIError(503, "no healthy engine serves this model", code="no_engines")
    headers = {**state.flow.headers, **request_id_header(request)}
    results = list(await asyncio.gather(*(_update(state, u, body, headers) for u in urls)))
    refused = next((r for r in results if r["status"] >= 400), None)
    if refused is not None:
        return JSONResponse({**refused["body"], "results": results}, refused["status"])
    return JSONResponse({"success": True, "results": results})


async def _update(
    state: ProxyState, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    """One engine's answer to the update, or a 502 entry when it gave none."""
    try:  # loading and draining take as long as they take
        r = await state.client.post(
            url + "/update_weights",
            json=body,
            headers=headers,
            timeout=httpx.Timeout(None, connect=10.0),
        )
        return {"url": url, "status": r.status_code, "body": r.json()}
    except (httpx.HTTPError, ValueError) as exc:
        return {"url": url, "status": 502, "body": {"error": f"{type(exc).__name__}"}}
