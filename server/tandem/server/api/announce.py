"""The engine's side of the node registry: ``tandem serve --proxy-url`` announces itself.

An engine that registers needs no static list in the proxy: it calls ``POST /nodes/add``
once it is up and ``POST /nodes/remove`` on the way down (the proxy's health polls drop it
anyway if it dies without saying so). The body is LMDeploy's, with the role as its
``EngineRole`` integer, so an LMDeploy proxy accepts a Tandem engine too.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from tandem.server.wire.roles import ROLE_IDS, parse_role

log = logging.getLogger("tandem.proxy")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def node_body(
    engine_url: str, role: str | int, models: list[str], kv_layout: str | None = None
) -> dict:
    """LMDeploy's ``/nodes/add`` body: ``{"url", "status": {"models", "role"}}``, plus
    Tandem's optional ``kv_layout`` (the proxy pairs prefill and decode of one layout)."""
    status: dict = {"models": list(models), "role": ROLE_IDS[parse_role(role)]}
    if kv_layout:
        status["kv_layout"] = kv_layout
    return {"url": engine_url.rstrip("/"), "status": status}


async def register_engine(
    proxy_url: str,
    engine_url: str,
    role: str | int,
    models: list[str],
    api_key: str | None = None,
    attempts: int = 30,
    delay: float = 1.0,
    kv_layout: str | None = None,
) -> None:
    """Add this engine to the proxy, retrying while the proxy is not up yet (engines and the
    proxy start together under ``tandem up`` and in a cluster). Raises after ``attempts``."""
    body = node_body(engine_url, role, models, kv_layout)
    last: Exception | None = None
    async with httpx.AsyncClient(timeout=10.0) as client:
        for i in range(max(1, attempts)):
            try:
                r = await client.post(
                    proxy_url.rstrip("/") + "/nodes/add", json=body, headers=_headers(api_key)
                )
                if r.status_code < 400:
                    log.info("registered with the proxy at %s as %s", proxy_url, body["status"])
                    return
                if r.status_code in (400, 401, 403, 404, 422):
                    raise RuntimeError(
                        f"the proxy at {proxy_url} refused the registration: "
                        f"{r.status_code} {r.text[:300]}"
                    )
                last = RuntimeError(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                last = exc
            if i + 1 < attempts:
                await asyncio.sleep(delay)
    raise RuntimeError(f"could not register with the proxy at {proxy_url}: {last}")


async def deregister_engine(
    proxy_url: str,
    engine_url: str,
    role: str | int = "both",
    models: list[str] | None = None,
    api_key: str | None = None,
) -> None:
    """Remove this engine from the proxy; best effort (the proxy may already be gone)."""
    body = node_body(engine_url, role, models or [])
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            await client.post(
                proxy_url.rstrip("/") + "/nodes/remove", json=body, headers=_headers(api_key)
            )
    except httpx.HTTPError as exc:
        log.info("could not deregister from the proxy at %s: %s", proxy_url, exc)
