"""The operator's own metrics, named as controller-runtime's (what Go operators export and
dashboards for them read): reconciles, errors, reconcile durations, the work queue's depth,
plus the Events it posts. Served at ``--metrics-address`` (the chart scrapes it).

Each :class:`OperatorMetrics` has its own registry (no process-wide state), so tests and a
second operator in one process never share counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

CONTROLLER = "inferenceservice"

log = logging.getLogger("tandem.operator")


def _registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=_registry)

    def __post_init__(self) -> None:
        labels = ["controller"]
        self.reconciles = Counter(
            "controller_runtime_reconcile_total",
            "Reconciles (render and server-side apply) per controller and result",
            [*labels, "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "controller_runtime_reconcile_errors_total",
            "Reconciles that failed (the API server refused an apply)",
            labels,
            registry=self.registry,
        )
        self.durations = Histogram(
            "controller_runtime_reconcile_time_seconds",
            "Time per reconcile",
            labels,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.depth = Gauge(
            "workqueue_depth",
            "Status refreshes scheduled and not yet run",
            ["name"],
            registry=self.registry,
        )
        self.events = Counter(
            "tandem_operator_events_total",
            "Kubernetes Events posted on InferenceServices, by type and reason",
            ["type", "reason"],
            registry=self.registry,
        )
        for result in ("success", "error"):
            self.reconciles.labels(CONTROLLER, result)
        self.errors.labels(CONTROLLER)

    def watch_queue(self, depth: Callable[[], int]) -> None:
        """Report ``depth()`` as the queue's depth at each scrape."""
        self.depth.labels(CONTROLLER).set_function(depth)

    @contextmanager
    def reconcile(self) -> Iterator[None]:
        """Time one reconcile and count it by its result (an exception is an error)."""
        began = time.perf_counter()
        try:
            yield
        except BaseException:
            self.reconciles.labels(CONTROLLER, "error").inc()
            self.errors.labels(CONTROLLER).inc()
            raise
        else:
            self.reconciles.labels(CONTROLLER, "success").inc()
        finally:
            self.durations.labels(CONTROLLER).observe(time.perf_counter() - began)

    def serve(self, address: str) -> int:
        """Serve ``/metrics`` at ``host:port`` (port 0: any free one); the bound port."""
        host, _, port = address.rpartition(":")
        server, _thread = start_http_server(
            int(port), addr=host or "0.0.0.0", registry=self.registry
        )
        bound = int(server.server_port)
        log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", bound)
        return bound
