"""The engines' load as the picker sees it: the model-server protocol's metrics (GIE proposal
003), scraped from each engine's ``/metrics`` onto the registry's nodes.

The proxy learns an engine's queue from its ``/health``; a gateway's picker reads the gauges
every GIE model server exposes, so a Tandem engine is scraped the way any vLLM-compatible one
would be: ``vllm:num_requests_waiting`` (its queue), ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc``, and ``vllm:cache_config_info``'s labels for the block pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.server.proxy.registry import Registry, every

log = logging.getLogger("tandem.picker")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape's reading of the protocol's gauges (None: the engine did not expose it)."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    num_blocks: int | None = None


PROTOCOL_NAMES = (WAITING, RUNNING, KV_USAGE, CACHE_INFO)


def parse_metrics(text: str) -> EngineMetrics:
    """The protocol's gauges out of a Prometheus text exposition (other names ignored).

    Only the protocol's lines reach the parser: an engine exposes some 160 lines, mostly
    histograms, and parsing them all took the picker 1.4 ms of CPU per scrape, twice a
    second per engine, on the cores the gateway's requests need (``docs/gateway.md``)."""
    found: dict[str, float] = {}
    info: dict[str, str] = {}
    wanted = "".join(
        line + "\n"
        for line in text.splitlines()
        if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(PROTOCOL_NAMES)
    )
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if sample.name in (WAITING, RUNNING, KV_USAGE):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
            elif sample.name == CACHE_INFO:
                info = dict(sample.labels)
    return EngineMetrics(
        waiting=int(found[WAITING]) if WAITING in found else None,
        running=int(found[RUNNING]) if RUNNING in found else None,
        kv_usage=found.get(KV_USAGE),
        block_size=_int(info.get("block_size")),
        num_blocks=_int(info.get("num_gpu_blocks")),
    )


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class MetricsScraper:
    """Scrapes every node's ``/metrics`` each ``interval`` seconds, all nodes at once;
    ``on_scraped(url, started)`` after each reading lands (``started``: monotonic)."""

    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        interval: float,
        on_scraped: Callable[[str, float], None] = lambda url, started: None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval = interval
        self.on_scraped = on_scraped

    async def scrape(self, url: str) -> None:
        started = time.monotonic()
        try:
            r = await self.client.get(url + "/metrics", timeout=max(1.0, self.interval * 2))
            r.raise_for_status()
            m = parse_metrics(r.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("scraping %s failed: %s", url, exc)
            return
        node = self.registry.get(url)
        if node is None:
            return
        node.pending = node.pending if m.waiting is None else m.waiting
        node.active = node.active if m.running is None else m.running
        node.kv_usage = m.kv_usage
        node.total_blocks = m.num_blocks if m.num_blocks is not None else node.total_blocks
        self.on_scraped(url, started)

    async def scrape_once(self) -> None:
        nodes = [n.url for n in self.registry.nodes() if n.healthy]
        if nodes:
            await asyncio.gather(*(self.scrape(u) for u in nodes))

    async def run(self) -> None:
        """Scrape until cancelled."""
        await every(self.interval, self.scrape_once, "metrics scrape")
