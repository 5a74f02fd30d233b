"""The operator's state: its options and the per-InferenceService bookkeeping every handler
shares. kopf hands it to each handler as ``memo.state`` (``handlers.operator_memo``)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .autoscaler.planner import PlannerState
from .kube import Kube
from .metrics import OperatorMetrics
from .render.options import RenderOptions
from .spec.status import InferenceServiceStatus
from .status.children import PlannerReport

T = TypeVar("T")

WRITE_THREADS = 4
"""Threads for status patches, Events and gate removals (:meth:`OperatorState.write`)."""


@dataclass(frozen=True)
class OperatorOptions:
    render: RenderOptions = RenderOptions()
    resync_seconds: float = 60.0
    peering: str | None = None
    """kopf peering object for leader election among replicas; None runs standalone."""
    namespaces: tuple[str, ...] = ()
    """Watched namespaces; empty is cluster-wide (and a ClusterKopfPeering)."""
    planner: bool = True
    """Run the Planner backend's loop; off when something else drives
    :func:`~.autoscaler.loop.run_planner` (``bench/autoscale.py --cluster``, in simulated time)."""
    metrics_address: str = ""
    """``host:port`` to serve the operator's own metrics at ('' serves none)."""


Key = tuple[str, str]


@dataclass
class OperatorState:
    """The operator's state, shared by every handler through ``memo.state``."""

    options: OperatorOptions
    kube: Kube | None = None
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    applied_generation: dict[Key, int] = field(default_factory=dict)
    apply_errors: dict[Key, str] = field(default_factory=dict)
    """The API server's message for an InferenceService whose last apply failed."""
    posted: dict[Key, dict[str, tuple[str, str]]] = field(default_factory=dict)
    """(status, reason) per condition type last posted as an Event: no repeats on resync."""
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    planner: dict[Key, PlannerState] = field(default_factory=dict)
    """The SLO planner's state (its stabilisation window) per InferenceService."""
    refreshes: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    """The status refresh scheduled per InferenceService (``reconcile.on_child_event``)."""
    held: dict[Key, bool] = field(default_factory=dict)
    """Whether the last apply held the old KV layout's engines (``rollout.py``)."""
    planner_reports: dict[Key, PlannerReport] = field(default_factory=dict)
    """How each InferenceService's last planner round went, for AutoscalingActive."""
    statuses: dict[Key, tuple[str | None, InferenceServiceStatus]] = field(default_factory=dict)
    """(uid, the status last written) per InferenceService: the next refresh compares with
    it, not with the body kopf hands over, which under load predates that write (comparing
    with the stale body rewrote the same status with a later lastTransitionTime, once per
    child event). The uid keeps a recreated namesake from inheriting it."""
    writes: ThreadPoolExecutor = field(default_factory=lambda: _pool(WRITE_THREADS))

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a status patch, an Event or a gate removal on threads of their own: in
        ``asyncio.to_thread``'s pool (a FIFO of min(32, cores + 4) threads) they queued behind
        every apply of a burst (1,000 services created at once), seconds each."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.writes, functools.partial(fn, *args))

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def client(self) -> Kube:
        assert self.kube is not None, "the client is created at startup"
        return self.kube

    def forget(self, key: Key) -> None:
        for table in (
            self.applied_generation,
            self.apply_errors,
            self.posted,
            self.locks,
            self.planner,
            self.planner_reports,
            self.held,
            self.statuses,
        ):
            table.pop(key, None)


def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="tandem-write")
