"""kopf's indexes: its watches of the children and the nodes, summarised, keyed by
(namespace, InferenceService name), and read back as the status's inputs.

kopf keeps each index in memory from its watches; the handlers receive every index as a
keyword argument named by its id (:data:`INDEXES`). Only summaries are kept, never bodies.
The index functions are ``async`` though they never await: kopf runs a plain function in
its thread pool, a thread hop per index per event (two per pod event), which at 1,000
services cost more than the summaries themselves.
"""

from __future__ import annotations

from typing import Any

import kopf

from .admission import GpuPod
from .bodies import ISVC, plain_body
from .render.meta import MANAGER, ROLE_LABEL, download_job_name
from .spec.roles import GPU_RESOURCE
from .state import Key
from .status.children import (
    AutoscalerSummary,
    Children,
    pod_gpus,
    pod_role,
    scaled_object_health,
    summarize_autoscaler,
    summarize_claim,
    summarize_deployment,
    summarize_job,
    summarize_leader_worker_set,
    summarize_pod,
    summarize_pool,
)
from .topology import ENGINE_SELECTOR_LABEL, Topology

MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
INDEXES = (
    "child_deployments",
    "child_leaderworkersets",
    "child_pods",
    "child_jobs",
    "child_claims",
    "child_autoscalers",
    "child_scaledobjects",
    "child_pools",
    "node_gpus",
    "gpu_pods",
)


@kopf.index(*ISVC, id="isvc_bodies")
async def isvc_bodies(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): plain_body(body)}


def owner_of(labels: kopf.Labels) -> str | None:
    return labels.get(ENGINE_SELECTOR_LABEL)


@kopf.index("apps", "v1", "deployments", id="child_deployments", labels=MANAGED)
async def child_deployments(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner, role = owner_of(labels), labels.get(ROLE_LABEL)
    return {(namespace, owner): summarize_deployment(dict(body), role)} if owner and role else {}


@kopf.index(
    "leaderworkerset.x-k8s.io",
    "v1",
    "leaderworkersets",
    id="child_leaderworkersets",
    labels=MANAGED,
)
def child_leaderworkersets(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """Pools of multi-node replicas; kopf skips the watch while LWS's CRD is not installed."""
    owner, role = owner_of(labels), labels.get(ROLE_LABEL)
    if not (owner and role):
        return {}
    return {(namespace, owner): summarize_leader_worker_set(dict(body), role)}


@kopf.index("", "v1", "pods", id="child_pods", labels=MANAGED)
async def child_pods(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner, role = owner_of(labels), pod_role(dict(labels))
    return {(namespace, owner): summarize_pod(dict(body), role)} if owner and role else {}


@kopf.index("batch", "v1", "jobs", id="child_jobs", labels=MANAGED)
async def child_jobs(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner = owner_of(labels)
    return {(namespace, owner): summarize_job(dict(body))} if owner else {}


@kopf.index("", "v1", "persistentvolumeclaims", id="child_claims", labels=MANAGED)
async def child_claims(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner = owner_of(labels)
    return {(namespace, owner): summarize_claim(dict(body))} if owner else {}


@kopf.index("autoscaling", "v2", "horizontalpodautoscalers", id="child_autoscalers", labels=MANAGED)
async def child_autoscalers(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner, role = owner_of(labels), labels.get(ROLE_LABEL)
    return {(namespace, owner): summarize_autoscaler(dict(body), role)} if owner and role else {}


@kopf.index("keda.sh", "v1alpha1", "scaledobjects", id="child_scaledobjects", labels=MANAGED)
async def child_scaledobjects(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner, role = owner_of(labels), labels.get(ROLE_LABEL)
    if not (owner and role):
        return {}
    health = scaled_object_health(dict(body))
    return {(namespace, owner): AutoscalerSummary(role, *health, kind="ScaledObject")}


@kopf.index("inference.networking.k8s.io", "v1", "inferencepools", id="child_pools", labels=MANAGED)
async def child_pools(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner = owner_of(labels)
    return {(namespace, owner): summarize_pool(dict(body))} if owner else {}


@kopf.index("", "v1", "nodes", id="node_gpus")
async def node_gpus(name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Allocatable GPUs per node: a pod asking for more than the largest is Unschedulable,
    and gang admission places pods into what the nodes have free."""
    allocatable = (body.get("status") or {}).get("allocatable") or {}
    return {None: (name, int(allocatable.get(GPU_RESOURCE) or 0))}


@kopf.index("", "v1", "pods", id="gpu_pods")
async def gpu_pods_index(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Every running or pending pod that asks for GPUs, wherever it is: what is not free."""
    if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return {}
    gpus = pod_gpus(dict(body))
    if not gpus:
        return {}
    spec = body.get("spec") or {}
    return {None: GpuPod(spec.get("nodeName"), gpus, bool(spec.get("schedulingGates")))}


def children_of(key: Key, topology: Topology, indexes: dict[str, kopf.Index]) -> Children:
    job_name = download_job_name(topology) if topology.model.kind == "hf" else None
    return Children(
        # a role's LeaderWorkerSet after its Deployment: the one that replaces it wins
        deployments=[
            *indexes["child_deployments"].get(key, []),
            *indexes["child_leaderworkersets"].get(key, []),
        ],
        pods=list(indexes["child_pods"].get(key, [])),
        jobs=[j for j in indexes["child_jobs"].get(key, []) if j.name == job_name],
        claims=list(indexes["child_claims"].get(key, [])),
        autoscalers=[
            *indexes["child_autoscalers"].get(key, []),
            *indexes["child_scaledobjects"].get(key, []),
        ],
        pools=list(indexes["child_pools"].get(key, [])),
    )


def largest_node_gpus(indexes: dict[str, kopf.Index]) -> int | None:
    """The most GPUs any node has allocatable; None while no node is known."""
    gpus = node_gpus_by_name(indexes).values()
    return max(gpus) if gpus else None


def node_gpus_by_name(indexes: dict[str, kopf.Index]) -> dict[str, int]:
    return dict(indexes["node_gpus"].get(None, []))


def gpu_pods(indexes: dict[str, kopf.Index]) -> list[GpuPod]:
    return list(indexes["gpu_pods"].get(None, []))


def index_kwargs(kwargs: dict[str, Any]) -> dict[str, kopf.Index]:
    return {k: kwargs[k] for k in INDEXES}
