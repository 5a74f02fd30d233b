"""One running picker: the registry and its pollers (the proxy's own, plus the metrics
scraper), discovery, and the gRPC server with the ext_proc service and gRPC health.

Health follows the protocol (GIE proposal 004): ``liveness`` is SERVING while the process
answers; ``readiness`` and the ext_proc service's own name are SERVING once the engines have
been polled once (the picker knows what it routes to), NOT_SERVING while it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from tandem.server.proxy.registry import HealthPoller, Registry

from .choice import Picker, PickerConfig
from .scrape import MetricsScraper
from .service import ExternalProcessor

log = logging.getLogger("tandem.picker")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"


@dataclass(frozen=True)
class PickerSettings:
    """Everything ``tandem epp`` configures."""

    config: PickerConfig = field(default_factory=PickerConfig)
    static_nodes: tuple[tuple[str, str], ...] = ()  # (url, role)
    health_interval: float = 2.0
    metrics_interval: float = 0.5
    dead_threshold: int = 3
    # e.g. Kubernetes discovery (the proxy's): started with the picker, given its registry
    discovery: Callable[[Registry], contextlib.AbstractAsyncContextManager[None]] | None = None


@contextlib.asynccontextmanager
async def running_picker(settings: PickerSettings, address: str) -> AsyncIterator[int]:
    """Serve the picker on ``address`` (``host:port``; port 0 picks one) until the block
    ends; yields the bound port."""
    registry = Registry(dead_threshold=settings.dead_threshold)
    for url, role in settings.static_nodes:
        registry.add(url, role, None, source="static")
    picker = Picker(registry, settings.config)
    health = health_aio.HealthServicer()
    await health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(address)
    async with httpx.AsyncClient(timeout=5.0) as client, contextlib.AsyncExitStack() as stack:
        poller = HealthPoller(
            registry, client, interval=settings.health_interval, secret=settings.config.internal_key
        )
        scraper = MetricsScraper(registry, client, settings.metrics_interval, picker.scraped)
        picker.suspect = poller.reprobe
        if settings.discovery is not None:
            await stack.enter_async_context(settings.discovery(registry))
        await server.start()
        await poller.poll_once()
        tasks = [asyncio.create_task(poller.run()), asyncio.create_task(scraper.run())]
        for service in (READINESS, EXT_PROC_SERVICE):
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        try:
            yield port
        finally:
            await health.enter_graceful_shutdown()
            await server.stop(grace=2.0)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await poller.aclose()


async def serve(settings: PickerSettings, address: str) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully: health NOT_SERVING first (the
    gateway stops asking), open exchanges given a moment to finish."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with running_picker(settings, address) as port:
        log.info(
            "endpoint picker on %s (port %d), %d static node(s)",
            address,
            port,
            len(settings.static_nodes),
        )
        await stop.wait()
    log.info("endpoint picker stopped")
