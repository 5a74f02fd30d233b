"""What every rendered pod shares: requests, security contexts, environment, scrape
annotations, its PodDisruptionBudget, and the merge of a role's ``podTemplate``. Pure."""

from __future__ import annotations

import copy
from typing import Any

from ..spec.inference_service import InferenceService
from ..spec.roles import GPU_RESOURCE, PodTemplate, Resources
from ..topology import RolePlan, Topology
from .meta import Manifest, object_meta, pool_name, selector_labels

GRACE_MARGIN_SECONDS = 10

# Requests when a role's resources leave them unset: pods are Burstable, not BestEffort, so
# the scheduler reserves room for the weights' host copy and the tokenizer threads.
DEFAULT_REQUESTS = {
    "engine": {"cpu": "2", "memory": "8Gi"},
    "proxy": {"cpu": "250m", "memory": "256Mi"},
    "download": {"cpu": "500m", "memory": "1Gi"},
}

# Strategic-merge keys of the pod fields a podTemplate may set (Kubernetes' patchMergeKey).
MERGE_KEYS = {"containers": "name", "volumes": "name", "volumeMounts": "mountPath", "env": "name"}


def container_resources(resources: Resources | None, gpus: int, kind: str) -> dict[str, Any]:
    requests = {**DEFAULT_REQUESTS[kind], **(resources.requests if resources else {})}
    limits = dict(resources.limits) if resources else {}
    if gpus > 0:
        limits[GPU_RESOURCE] = str(gpus)
        requests[GPU_RESOURCE] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def scrape_annotations(port: int) -> dict[str, str]:
    """The ``prometheus.io/*`` pod annotations that annotation-based scrape configs follow
    (where no Prometheus Operator runs; its PodMonitor, from the chart, ignores them)."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def env_vars(env: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def pod_disruption_budget(isvc: InferenceService, topology: Topology, role: RolePlan) -> Manifest:
    component = "engine" if role.is_engine else "proxy"
    max_unavailable = role.spec.max_unavailable if role.spec else 1
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(isvc, topology, pool_name(topology, role), component, role.role),
        "spec": {
            "maxUnavailable": max_unavailable,
            "selector": {"matchLabels": selector_labels(topology, role.role)},
            # a crash-looping pod must not block draining its node
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Kubernetes' strategic merge of ``patch`` into ``base`` for the keys in MERGE_KEYS:
    maps merge, keyed lists merge item by item, other lists and scalars replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    merge_key = MERGE_KEYS.get(key or "")
    if merge_key and isinstance(base, list) and isinstance(patch, list):
        out_list = [dict(item) for item in base]
        index = {item.get(merge_key): i for i, item in enumerate(out_list)}
        for item in patch:
            at = index.get(item.get(merge_key))
            if at is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[at] = _merge(out_list[at], item)
        return out_list
    return copy.deepcopy(patch)


def merge_pod_template(template: Manifest, override: PodTemplate) -> Manifest:
    """A role's ``podTemplate`` merged into its rendered pod template. The rendered labels
    the selectors and the proxy depend on win over an override of the same key."""
    patch = {
        "metadata": override.metadata.model_dump(by_alias=True),
        "spec": override.spec.model_dump(by_alias=True, exclude_none=True),
    }
    patch["metadata"] = {k: v for k, v in patch["metadata"].items() if v}
    patch["spec"] = {k: v for k, v in patch["spec"].items() if v}
    merged = _merge(template, patch)
    merged["metadata"]["labels"] = {
        **override.metadata.labels,
        **template["metadata"]["labels"],
    }
    return merged
