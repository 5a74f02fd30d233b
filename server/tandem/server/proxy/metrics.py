"""The proxy's Prometheus metrics: the flow's counters and the registry's node gauges, read
at scrape time (nothing is kept twice)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from tandem.server.wire.roles import ROLE_IDS

from .pd_flow import FlowStats
from .registry import Node
from .state import ProxyState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Family = CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily


class ProxyCollector(Collector):
    """The proxy's counters and node gauges, read at scrape time."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def collect(self) -> Iterator[Family]:
        stats = self.state.flow.stats
        yield from _request_counters(stats)
        yield SummaryMetricFamily(
            "tandem_proxy_request_seconds",
            "Time to the start of the response",
            count_value=stats.latency_count,
            sum_value=stats.latency_sum,
        )
        yield from _node_gauges(self.state.registry.nodes())


def _request_counters(stats: FlowStats) -> Iterator[CounterMetricFamily]:
    c = CounterMetricFamily(
        "tandem_proxy_requests",
        "Requests answered, by route, mode and status",
        labels=["route", "mode", "status"],
    )
    for (route, mode, status), n in sorted(stats.requests.items()):
        c.add_metric([route, mode, str(status)], n)
    yield c
    for name, doc, value in [
        (
            "tandem_proxy_prefill_failures",
            "Prefill steps that failed and were retried elsewhere",
            stats.prefill_failures,
        ),
        ("tandem_proxy_decode_failures", "Decode steps that failed", stats.decode_failures),
        (
            "tandem_proxy_lease_releases",
            "Prefill leases released by the proxy",
            stats.lease_releases,
        ),
        (
            "tandem_proxy_aggregated_fallbacks",
            "Disaggregated requests served on one engine instead",
            stats.fallbacks_aggregated,
        ),
        (
            "tandem_proxy_client_disconnects",
            "Clients that left before their answer",
            stats.client_disconnects,
        ),
        (
            "tandem_proxy_stalls",
            "Engines given up on by a request for making no progress (--stall-timeout)",
            stats.stalls,
        ),
        (
            "tandem_proxy_engine_waits",
            "Requests that waited for an engine expected back (restarting, stalled)",
            stats.waits,
        ),
        (
            "tandem_proxy_unserved_requests",
            "Requests refused because no engine was running (activates a pool at zero)",
            stats.unserved,
        ),
    ]:
        yield CounterMetricFamily(name, doc, value=value)


def _node_gauges(nodes: list[Node]) -> Iterator[GaugeMetricFamily]:
    g = GaugeMetricFamily(
        "tandem_proxy_nodes", "Known engines, by role and health", labels=["role", "healthy"]
    )
    for role in ROLE_IDS:
        for healthy in (True, False):
            g.add_metric(
                [role, str(healthy).lower()],
                sum(1 for n in nodes if n.role == role and n.healthy == healthy),
            )
    yield g
    g = GaugeMetricFamily(
        "tandem_proxy_in_flight", "Requests the proxy has open, by engine", labels=["node"]
    )
    for n in nodes:
        g.add_metric([n.url], n.inflight)
    yield g
