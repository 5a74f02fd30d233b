"""The ``Planner`` backend's loop: live metrics in, both pools' replicas out. The I/O edge.

Every control interval the operator reads, from the Prometheus that scrapes the chart's
PodMonitor, what the planner needs (:func:`~.metrics.queries`), lets
:func:`~.planner.decide` choose, and writes the two Deployments' scale subresources. The
planner's state (its stabilisation window) is kept per InferenceService by the caller;
losing it on a restart only restarts the window.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

from ..render.meta import child_base
from ..spec.inference_service import InferenceService
from .metrics import queries
from .planner import Decision, PlannerState, config_for, decide
from .profile import PROFILE_KEY, EngineProfile


def prometheus_query(address: str, query: str, timeout: float = 10.0) -> float | None:
    """One instant query's scalar (the first sample), None when it has no series."""
    url = f"{address.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (configured URL)
        body: dict[str, Any] = json.load(resp)
    result = body.get("data", {}).get("result") or []
    return float(result[0]["value"][1]) if result else None


def read_samples(address: str, namespace: str, instance: str) -> dict[str, float | None]:
    return {k: prometheus_query(address, q) for k, q in queries(namespace, instance).items()}


def _scale_path(namespace: str, deployment: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"


def run_planner(
    kube: Any, isvc: InferenceService, state: PlannerState | None, now: float
) -> Decision:
    """One round against the cluster: read the profile and the metrics, decide, set the
    scale of both pools (only when it changes). ``kube`` is a :class:`~.kube.Kube`."""
    spec, ns, name = isvc.spec, isvc.metadata.namespace, isvc.metadata.name
    assert spec.slo is not None and spec.prefill is not None and spec.prefill.autoscaling
    cm = kube.request("GET", f"/api/v1/namespaces/{ns}/configmaps/{spec.slo.profile_config_map}")
    profile = EngineProfile.from_dict(json.loads(cm["data"][PROFILE_KEY]))
    samples = read_samples(spec.prefill.autoscaling.prometheus_address, ns, name)
    pools = (f"{child_base(name)}-prefill", f"{child_base(name)}-decode")
    scales = [kube.request("GET", _scale_path(ns, p)) for p in pools]
    current = tuple(int((s.get("spec") or {}).get("replicas") or 0) for s in scales)
    decision = decide(state, now, samples, config_for(isvc, profile), (current[0], current[1]))
    for pool, have, want in zip(pools, current, (decision.prefill, decision.decode), strict=True):
        if have != want:
            kube.request(
                "PATCH",
                _scale_path(ns, pool),
                {"spec": {"replicas": want}},
                content_type="application/merge-patch+json",
            )
    return decision
