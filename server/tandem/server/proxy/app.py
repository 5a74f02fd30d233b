"""The proxy's FastAPI app: OpenAI routes in front, LMDeploy's node and DistServe routes beside.

The routes live in one module each (``engine_routes``, ``model_routes``, ``session_routes``,
``weights_routes``, ``node_routes``, ``distserve_routes``, ``ops_routes``), as the engine
server's do; everything the app holds lives on ``app.state.proxy`` (``state.ProxyState``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI

from tandem.server.wire import agent_routes
from tandem.server.wire.auth import (
    PROXY_ADMIN_PATHS,
    PROXY_ADMIN_PREFIXES,
    AuthMiddleware,
    Credentials,
)
from tandem.server.wire.body import JSONBodyGuard, ParsedJSONRoute
from tandem.server.wire.edge import install_edge
from tandem.server.wire.errors import install_error_handlers
from tandem.server.wire.protocol import ERROR_RESPONSES

from . import (
    agent_apis,
    distserve_routes,
    engine_routes,
    model_routes,
    node_routes,
    ops_routes,
    session_routes,
    weights_routes,
)
from .pd_flow import PDFlow
from .registry import HealthPoller, Registry
from .state import ProxySettings, ProxyState

# In the order a reader of the OpenAPI document meets them.
_ROUTERS = (
    engine_routes,
    agent_routes,
    session_routes,
    weights_routes,
    model_routes,
    node_routes,
    distserve_routes,
    ops_routes,
)


def build_app(settings: ProxySettings) -> FastAPI:
    """One proxy. Engines join through ``settings.static_nodes``, ``POST /nodes/add`` or discovery."""
    state = _proxy_state(settings)
    app = FastAPI(
        title="Tandem proxy",
        version="0.1.0",
        lifespan=_lifespan(state),
        responses=ERROR_RESPONSES,
        description="One OpenAI endpoint over prefill, decode and aggregated Tandem engines.",
    )
    app.router.route_class = ParsedJSONRoute
    app.state.proxy = state
    app.state.agent_apis = agent_apis.agent_apis()
    install_error_handlers(app)
    for module in _ROUTERS:
        app.include_router(module.router)
    app.add_middleware(JSONBodyGuard)  # inside auth: no body is read for an unknown caller
    credentials = _credentials(settings)
    if not credentials.open:
        app.add_middleware(
            AuthMiddleware,
            credentials=credentials,
            admin_paths=PROXY_ADMIN_PATHS,
            admin_prefixes=PROXY_ADMIN_PREFIXES,
        )
    install_edge(app, settings.edge)
    return app


def _proxy_state(settings: ProxySettings) -> ProxyState:
    """The registry (static nodes in it), the shared HTTP client, the flow and the poller."""
    registry = Registry(
        dead_threshold=settings.dead_threshold,
        startup_grace=settings.startup_grace,
        forget_after=settings.forget_after,
    )
    for url, role in settings.static_nodes:
        registry.add(url, role, None, source="static")
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        timeout=httpx.Timeout(settings.flow.request_timeout, connect=settings.flow.connect_timeout),
    )
    flow = PDFlow(registry, client, settings.flow)
    poller = HealthPoller(
        registry, client, interval=settings.health_interval, secret=settings.flow.engine_api_key
    )
    flow.reprobe = poller.reprobe  # a request waiting on an engine probes it now
    return ProxyState(settings=settings, registry=registry, flow=flow, client=client, poller=poller)


def _lifespan(
    state: ProxyState,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Poll once before serving, keep polling, run discovery; close it all on the way out."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        poller, discovery = state.poller, state.settings.discovery
        await poller.poll_once()
        task = asyncio.create_task(poller.run())
        async with contextlib.AsyncExitStack() as stack:
            if discovery is not None:
                await stack.enter_async_context(discovery(state.registry))
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await poller.aclose()
                await state.flow.aclose()
                await state.client.aclose()

    return lifespan


def _credentials(settings: ProxySettings) -> Credentials:
    """The proxy is the clients' front door: with no client key configured, clients need
    none (the admin and internal planes stay closed)."""
    c = settings.credentials
    clients = c.client_keys | ({settings.api_key} if settings.api_key else set())
    return Credentials(frozenset(clients), c.internal_key, c.admin_key, keyless_clients=True)
