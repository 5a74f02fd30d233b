"""LMDeploy's DistServe routes on the proxy: connect every decode engine to every prefill
engine ahead of traffic (``connection_warmup``), and sweep expired leases (``gc``)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tandem.server.wire.body import ParsedJSONRoute

from .registry import DECODE_ROLES, PREFILL_ROLES
from .state import ProxyState, get_state

router = APIRouter(route_class=ParsedJSONRoute)


@router.post("/distserve/connection_warmup")
async def connection_warmup(request: Request) -> JSONResponse:
    """Have every decode engine connect to every prefill engine now (``p2p_connect``),
    so the first request pays no handshake and a KV layout mismatch shows up here."""
    state = get_state(request)
    return await _warmup(state)


@router.post("/distserve/gc")
async def gc(request: Request) -> dict[str, Any]:
    """Sweep expired leases on every prefill engine."""
    state = get_state(request)
    nodes = state.registry.routable(PREFILL_ROLES)

    async def one(url: str) -> dict[str, Any]:
        try:
            r = await state.client.post(
                url + "/distserve/gc", headers=state.flow.headers, timeout=10.0
            )
            return {"url": url, "status": r.status_code}
        except httpx.HTTPError as exc:
            return {"url": url, "error": f"{type(exc).__name__}: {exc}"}

    return {"results": list(await asyncio.gather(*(one(n.url) for n in nodes)))}


async def _warmup(state: ProxyState) -> JSONResponse:
    """Each prefill engine's transport, then each decode engine's connection to it: one
    result per pair, 502 unless every pair connected."""
    prefills = state.registry.routable(PREFILL_ROLES)
    decodes = state.registry.routable(DECODE_ROLES)
    results: list[dict[str, Any]] = []
    infos = await asyncio.gather(*(_engine_info(state, p.url) for p in prefills))
    jobs = []
    for p, p_info in zip(prefills, infos):
        if isinstance(p_info, str):
            results.extend(
                {"prefill": p.url, "decode": d.url, "ok": False, "error": p_info} for d in decodes
            )
            continue
        jobs.extend(_connect(state, p.url, p_info, d.url) for d in decodes if d.url != p.url)
    results.extend(await asyncio.gather(*jobs))
    ok = all(r["ok"] for r in results)
    return JSONResponse({"ok": ok, "connections": results}, status_code=200 if ok else 502)


async def _engine_info(state: ProxyState, url: str) -> dict[str, Any] | str:
    """A prefill engine's ``engine_info``, or why it gave none."""
    try:
        r = await state.client.get(
            url + "/distserve/engine_info", headers=state.flow.headers, timeout=10.0
        )
        return (
            r.json()
            if r.status_code == 200
            else f"engine_info answered {r.status_code}: {r.text[:200]}"
        )
    except (httpx.HTTPError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def _connect(
    state: ProxyState, p_url: str, p_info: dict[str, Any], d_url: str
) -> dict[str, Any]:
    """Decode engine ``d_url`` connects to the prefill engine at ``p_url``: one pair's result."""
    body = {
        "remote_engine_id": p_info.get("engine_id"),
        "remote_engine_endpoint_info": {
            "zmq_address": (p_info.get("transport") or {}).get("address") or p_info.get("address")
        },
        "remote_engine_url": p_url,
    }
    pair = {"prefill": p_url, "decode": d_url}
    try:
        r = await state.client.post(
            d_url + "/distserve/p2p_connect", json=body, headers=state.flow.headers, timeout=30.0
        )
    except httpx.HTTPError as exc:
        return {**pair, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ok = r.status_code < 400
    return {**pair, "ok": ok, "status": r.status_code, **({} if ok else {"error": r.text[:300]})}
