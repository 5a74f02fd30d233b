"""What status is computed from: summaries of the children's bodies, and the operator's
own facts. Pure: the kopf indexes keep these summaries, not the bodies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..render.meta import (
    GROUP_WORKER_COMPONENT,
    KV_LAYOUT_LABEL,
    MODEL_CACHED_ANNOTATION,
    ROLE_LABEL,
)
from ..spec.roles import GPU_RESOURCE
from ..topology import COMPONENT_LABEL

DOWNLOAD_ROLE = "download"


@dataclass(frozen=True)
class DeploymentSummary:
    """What status needs from a Deployment; built from its body by :func:`summarize_deployment`."""

    role: str
    generation: int
    observed_generation: int
    desired: int
    ready: int
    updated: int
    available: int
    deadline_exceeded: bool = False
    replica_failure: str | None = None
    """The API server's refusal of a pod (``ReplicaFailure=True``, reason ``FailedCreate``:
    a quota, an admission policy, a missing PriorityClass), as the Deployment copies it from
    its ReplicaSet."""
    total: int | None = None
    """Pods of every revision (``status.replicas``): above ``updated`` while old pods remain."""
    kind: str = "Deployment"
    """Or ``LeaderWorkerSet``: a pool of multi-node replicas, its counts in groups."""


@dataclass(frozen=True)
class PodSummary:
    role: str
    ready: bool
    unschedulable: str | None = None
    """The scheduler's message when PodScheduled=False/Unschedulable."""
    waiting_reason: str | None = None
    """e.g. CrashLoopBackOff, ImagePullBackOff, CreateContainerConfigError."""
    terminating: bool = False
    waiting_message: str = ""
    kv_layout: str | None = None
    name: str = ""
    gpus: int = 0
    """GPUs its containers request."""
    node: str | None = None
    gates: tuple[str, ...] = ()
    """Its ``schedulingGates`` (the operator's gang admission holds it while one is there)."""
    group_worker: bool = False
    """A multi-node group's non-leader pod: it runs ranks and serves nothing, so it never
    makes a serving path (its group's leader does, once the whole group has joined)."""


@dataclass(frozen=True)
class JobSummary:
    name: str
    succeeded: bool
    failed: bool
    message: str = ""


@dataclass(frozen=True)
class ClaimSummary:
    name: str
    phase: str
    storage_class: str | None = None
    cached_model: str | None = None
    """The model a finished download left in it (an annotation the operator writes)."""


@dataclass(frozen=True)
class AutoscalerSummary:
    role: str
    scaling_active: bool | None
    """None while its controller has not reported (or is not installed)."""
    reason: str = ""
    message: str = ""
    kind: str = "HorizontalPodAutoscaler"


@dataclass(frozen=True)
class PoolSummary:
    """An InferencePool's acceptance by the Gateways that route to it (``status.parents``):
    ``accepted`` None while no Gateway has reported on it."""

    name: str
    accepted: bool | None
    reason: str = ""
    message: str = ""


def summarize_pool(body: dict[str, Any]) -> PoolSummary:
    """A refusing Gateway wins over accepting ones: the pool is not served everywhere."""
    name = (body.get("metadata") or {}).get("name", "")
    found: list[tuple[bool, str, str]] = []
    for parent in (body.get("status") or {}).get("parents") or []:
        gateway = (parent.get("parentRef") or {}).get("name", "")
        for c in parent.get("conditions") or []:
            if c.get("type") == "Accepted" and c.get("status") in ("True", "False"):
                message = f"Gateway {gateway}: {c.get('message') or ''}".strip()
                found.append((c.get("status") == "True", c.get("reason") or "", message))
    if not found:
        return PoolSummary(name, None)
    return PoolSummary(name, *min(found, key=lambda f: f[0]))


@dataclass(frozen=True)
class Children:
    """An InferenceService's children; ``jobs`` holds only the current spec's download Job."""

    deployments: list[DeploymentSummary] = field(default_factory=list)
    pods: list[PodSummary] = field(default_factory=list)
    jobs: list[JobSummary] = field(default_factory=list)
    claims: list[ClaimSummary] = field(default_factory=list)
    autoscalers: list[AutoscalerSummary] = field(default_factory=list)
    pools: list[PoolSummary] = field(default_factory=list)


@dataclass(frozen=True)
class PlannerReport:
    """How the Planner backend's last round went: what it set, or why it could not. Only
    what changes with the outcome, so a steady planner does not rewrite the status."""

    ok: bool
    message: str


@dataclass(frozen=True)
class Facts:
    """What the operator itself knows, beside the children."""

    apply_error: str | None = None
    """The API server's message when the last apply failed."""
    largest_node_gpus: int | None = None
    """The most GPUs any node has allocatable (None: nodes not known yet)."""
    planner: PlannerReport | None = None
    """The SLO planner loop's last round (None: none finished yet)."""
    held: str | None = None
    """What the operator's gang admission keeps gated and why (None: nothing waits)."""


def summarize_deployment(body: dict[str, Any], role: str) -> DeploymentSummary:
    spec, status, meta = (
        body.get("spec") or {},
        body.get("status") or {},
        body.get("metadata") or {},
    )
    conditions = status.get("conditions") or []
    return DeploymentSummary(
        role=role,
        generation=int(meta.get("generation") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        desired=int(spec["replicas"] if spec.get("replicas") is not None else 1),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        available=int(status.get("availableReplicas") or 0),
        deadline_exceeded=any(
            c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
            for c in conditions
        ),
        total=int(status.get("replicas") or 0),
        replica_failure=next(
            (
                c.get("message") or c.get("reason") or "FailedCreate"
                for c in conditions
                if c.get("type") == "ReplicaFailure" and c.get("status") == "True"
            ),
            None,
        ),
    )


def summarize_leader_worker_set(body: dict[str, Any], role: str) -> DeploymentSummary:
    """A LeaderWorkerSet (a pool of multi-node replicas) in a Deployment's terms, counted
    in groups: LWS's ``readyReplicas`` are groups whose every pod is ready."""
    spec, status, meta = (
        body.get("spec") or {},
        body.get("status") or {},
        body.get("metadata") or {},
    )
    ready = int(status.get("readyReplicas") or 0)
    generation = int(meta.get("generation") or 0)
    return DeploymentSummary(
        role=role,
        generation=generation,
        observed_generation=_lws_observed(status.get("conditions") or [], generation),
        desired=int(spec["replicas"] if spec.get("replicas") is not None else 1),
        ready=ready,
        updated=int(status.get("updatedReplicas") or 0),
        available=ready,
        total=int(status.get("replicas") or 0),
        kind="LeaderWorkerSet",
    )


def _lws_observed(conditions: list[dict[str, Any]], generation: int) -> int:
    """The generation LWS's counts are for. Its status has no ``observedGeneration`` and
    v0.8.0's controller sets none on its conditions: there, no condition yet, or a True
    ``UpdateInProgress``, means the latest spec is not rolled out (``Progressing`` only says
    not every group is ready), and otherwise the counts are taken as current (so, for the
    instant between an update and the controller's next status write, the old counts
    stand). A condition that does carry one is believed."""
    stated = [int(c["observedGeneration"]) for c in conditions if c.get("observedGeneration")]
    if stated:
        return max(stated)
    busy = any(
        c.get("type") == "UpdateInProgress" and c.get("status") == "True" for c in conditions
    )
    return generation - 1 if busy or not conditions else generation


def summarize_pod(body: dict[str, Any], role: str) -> PodSummary:
    status, meta = body.get("status") or {}, body.get("metadata") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "Unschedulable"
    waiting, waiting_message = None, ""
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for cs in statuses:
        state = (cs.get("state") or {}).get("waiting") or {}
        reason = state.get("reason")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            waiting, waiting_message = reason, state.get("message") or ""
    return PodSummary(
        role=role,
        ready=ready,
        unschedulable=unschedulable,
        waiting_reason=waiting,
        terminating=bool(meta.get("deletionTimestamp")),
        waiting_message=waiting_message,
        kv_layout=(meta.get("labels") or {}).get(KV_LAYOUT_LABEL),
        name=meta.get("name") or "",
        gpus=pod_gpus(body),
        node=(body.get("spec") or {}).get("nodeName"),
        gates=tuple(
            g.get("name", "") for g in (body.get("spec") or {}).get("schedulingGates") or []
        ),
        group_worker=(meta.get("labels") or {}).get(COMPONENT_LABEL) == GROUP_WORKER_COMPONENT,
    )


def pod_gpus(body: dict[str, Any]) -> int:
    """The GPUs a pod's containers request (a limit alone sets the request)."""
    total = 0
    for c in (body.get("spec") or {}).get("containers") or []:
        resources = c.get("resources") or {}
        value = (resources.get("requests") or {}).get(GPU_RESOURCE) or (
            resources.get("limits") or {}
        ).get(GPU_RESOURCE)
        total += int(value or 0)
    return total


def pod_role(labels: dict[str, str]) -> str | None:
    """The pool a child pod belongs to: an engine/proxy role, or the model download."""
    if labels.get("app.kubernetes.io/component") == "model-download":
        return DOWNLOAD_ROLE
    return labels.get(ROLE_LABEL)


def summarize_job(body: dict[str, Any]) -> JobSummary:
    status = body.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    failed = conditions.get("Failed") or {}
    return JobSummary(
        name=body["metadata"]["name"],
        succeeded=(conditions.get("Complete") or {}).get("status") == "True"
        or int(status.get("succeeded") or 0) > 0,
        failed=failed.get("status") == "True",
        message=" ".join(x for x in (failed.get("reason"), failed.get("message")) if x),
    )


def summarize_claim(body: dict[str, Any]) -> ClaimSummary:
    meta = body.get("metadata") or {}
    return ClaimSummary(
        name=meta["name"],
        phase=(body.get("status") or {}).get("phase") or "Pending",
        storage_class=(body.get("spec") or {}).get("storageClassName"),
        cached_model=(meta.get("annotations") or {}).get(MODEL_CACHED_ANNOTATION),
    )


def summarize_autoscaler(body: dict[str, Any], role: str) -> AutoscalerSummary:
    conditions = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    active = conditions.get("ScalingActive")
    if active is None:
        return AutoscalerSummary(role, None)
    return AutoscalerSummary(
        role,
        active.get("status") == "True",
        active.get("reason") or "",
        active.get("message") or "",
    )


def scaled_object_health(body: dict[str, Any]) -> tuple[bool | None, str, str]:
    """(able to scale, reason, message) of a ScaledObject, as ``AutoscalerSummary`` takes
    them for an HPA's ``ScalingActive``: its ``Ready`` condition says whether KEDA resolved
    its triggers and target; ``Active`` whether there is demand now (an inactive one, a pool
    at zero with no demand, is healthy). None while KEDA has not reported: with no KEDA
    controller in the cluster, nothing ever scales the pool."""
    conditions = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    ready = conditions.get("Ready")
    if ready is None or ready.get("status") == "Unknown":
        return None, "", ""
    ok = ready.get("status") == "True"
    message = ready.get("message") or ""
    if ok:
        active = (conditions.get("Active") or {}).get("status") == "True"
        message = f"{message}; {'active' if active else 'inactive (no demand)'}".lstrip("; ")
    return (
        ok,
        ready.get("reason") or ("ScaledObjectReady" if ok else "ScaledObjectNotReady"),
        message,
    )
