"""What one proxy app holds: its settings (``tandem proxy``'s flags) and the state its routes
share (registry, flow, HTTP client, poller), on ``app.state.proxy``, so two proxies in one
process (tests) share nothing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from fastapi import Request

from tandem.server.wire.auth import Credentials
from tandem.server.wire.edge import DEFAULT_MAX_TOKENS, EdgeSettings

from .node_address import NodeNetworks
from .pd_flow import FlowConfig, PDFlow
from .registry import HealthPoller, Registry


@dataclass
class ProxySettings:
    """Everything ``tandem proxy`` configures; the app factory's one argument.

    ``api_key`` is one client key; ``credentials`` the full set (client keys, internal,
    admin; ``docs/security.md``), to which ``api_key`` is added."""

    api_key: str | None = None
    credentials: Credentials = field(default_factory=Credentials)
    flow: FlowConfig = field(default_factory=FlowConfig)
    static_nodes: list[tuple[str, str]] = field(default_factory=list)  # (url, role)
    health_interval: float = 2.0
    dead_threshold: int = 3
    startup_grace: float = 600.0
    # seconds an engine that answered before may stay down (stalled, restarting) before it
    # is forgotten; it is probed with a backoff meanwhile (--forget-after)
    forget_after: float = 600.0
    edge: EdgeSettings = field(default_factory=EdgeSettings)
    # max_tokens the proxy writes into a chat request that sets none (--default-max-tokens).
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    # Started with the app, stopped with it: e.g. Kubernetes discovery. Gets the registry.
    discovery: Callable[[Registry], contextlib.AbstractAsyncContextManager[None]] | None = None
    # Where POST /nodes/add may point (--allow-node-networks); link-local never.
    node_networks: NodeNetworks = field(default_factory=NodeNetworks)


@dataclass
class ProxyState:
    settings: ProxySettings
    registry: Registry
    flow: PDFlow
    client: httpx.AsyncClient
    poller: HealthPoller
    started_at: float = field(default_factory=time.time)
    created: int = field(default_factory=lambda: int(time.time()))


def get_state(request: Request) -> ProxyState:
    return request.app.state.proxy
