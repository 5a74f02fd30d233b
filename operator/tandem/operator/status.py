"""Children -> status. Pure: the handlers feed it summaries of what exists and write what it returns.

Status is recomputed whole every time from the children (level-based), never accumulated,
so an operator restart or a missed event cannot leave it stale. Only a condition's
``lastTransitionTime`` is carried over from the previous status, when its value is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan import Topology
from .render import service_url
from .spec import GPU_RESOURCE, InferenceService


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


@dataclass(frozen=True)
class PodSummary:
    role: str
    ready: bool
    unschedulable: str | None = (
        None  # the scheduler's message when PodScheduled=False/Unschedulable
    )
    waiting_reason: str | None = None  # e.g. CrashLoopBackOff, ImagePullBackOff
    terminating: bool = False


@dataclass(frozen=True)
class JobSummary:
    name: str
    succeeded: bool
    failed: bool


@dataclass(frozen=True)
class Children:
    deployments: list[DeploymentSummary] = field(default_factory=list)
    pods: list[PodSummary] = field(default_factory=list)
    jobs: list[JobSummary] = field(default_factory=list)


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
        desired=int(spec.get("replicas", 1) if spec.get("replicas") is not None else 1),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        available=int(status.get("availableReplicas") or 0),
        deadline_exceeded=any(
            c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
            for c in conditions
        ),
    )


def summarize_pod(body: dict[str, Any], role: str) -> PodSummary:
    status, meta = body.get("status") or {}, body.get("metadata") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "Unschedulable"
    waiting = None
    for cs in status.get("containerStatuses") or []:
        reason = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            waiting = reason
    return PodSummary(
        role=role,
        ready=ready,
        unschedulable=unschedulable,
        waiting_reason=waiting,
        terminating=bool(meta.get("deletionTimestamp")),
    )


def summarize_job(body: dict[str, Any]) -> JobSummary:
    status = body.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return JobSummary(
        name=body["metadata"]["name"],
        succeeded=conditions.get("Complete") == "True" or int(status.get("succeeded") or 0) > 0,
        failed=conditions.get("Failed") == "True",
    )


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }


ROLE_CONDITIONS = {
    "prefill": "PrefillReady",
    "decode": "DecodeReady",
    "both": "DecodeReady",
    "proxy": "ProxyReady",
}
STATUS_KEYS = {"prefill": "prefill", "decode": "decode", "both": "decode", "proxy": "proxy"}


def _role_state(
    role: str,
    desired_replicas: int,
    deployment: DeploymentSummary | None,
    pods: list[PodSummary],
    model_ready: bool,
) -> tuple[dict[str, Any], dict[str, Any], bool, str | None]:
    """(role status, role condition, rolling?, degraded reason) for one pool."""
    if deployment is None:
        desired = desired_replicas
        counts = {
            "desired": desired,
            "ready": 0,
            "updated": 0,
            "available": 0,
            "replicas": f"0/{desired}",
        }
        reason, message = (
            ("WaitingForModel", "the model download has not finished")
            if not model_ready
            else ("Creating", "the Deployment does not exist yet")
        )
        return counts, _condition(ROLE_CONDITIONS[role], False, reason, message), True, None
    d = deployment
    counts = {
        "desired": d.desired,
        "ready": d.ready,
        "updated": d.updated,
        "available": d.available,
        "replicas": f"{d.ready}/{d.desired}",
    }
    live = [p for p in pods if not p.terminating]
    rolled = d.observed_generation >= d.generation and d.updated >= d.desired
    ready = rolled and d.ready >= d.desired
    no_gpu = next(
        (p.unschedulable for p in live if p.unschedulable and GPU_RESOURCE in p.unschedulable), None
    )
    unschedulable = next((p.unschedulable for p in live if p.unschedulable), None)
    waiting = next((p.waiting_reason for p in live if p.waiting_reason), None)
    degraded: str | None = None
    if ready:
        cond = _condition(
            ROLE_CONDITIONS[role], True, "Ready", f"{d.ready}/{d.desired} replicas ready"
        )
    elif no_gpu:
        degraded = "WaitingForGPUs"
        cond = _condition(
            ROLE_CONDITIONS[role],
            False,
            "WaitingForGPUs",
            f"{d.ready}/{d.desired} ready; pods wait for {GPU_RESOURCE}: {no_gpu}",
        )
    elif unschedulable:
        degraded = "Unschedulable"
        cond = _condition(
            ROLE_CONDITIONS[role],
            False,
            "Unschedulable",
            f"{d.ready}/{d.desired} ready; {unschedulable}",
        )
    elif waiting:
        degraded = waiting
        cond = _condition(
            ROLE_CONDITIONS[role],
            False,
            waiting,
            f"{d.ready}/{d.desired} ready; a container is {waiting}",
        )
    elif d.deadline_exceeded:
        degraded = "ProgressDeadlineExceeded"
        cond = _condition(
            ROLE_CONDITIONS[role],
            False,
            "ProgressDeadlineExceeded",
            f"{d.ready}/{d.desired} ready after the rollout deadline",
        )
    elif not rolled:
        cond = _condition(
            ROLE_CONDITIONS[role],
            False,
            "RollingUpdate",
            f"{d.updated}/{d.desired} replicas updated, {d.ready} ready",
        )
    else:
        cond = _condition(
            ROLE_CONDITIONS[role], False, "PodsNotReady", f"{d.ready}/{d.desired} replicas ready"
        )
    return counts, cond, not ready and degraded is None, degraded


def compute_status(
    isvc: InferenceService,
    topology: Topology,
    children: Children,
    observed_generation: int | None,
    now: str,
    previous: dict[str, Any] | None = None,
    autoscaler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole ``status`` of an InferenceService from its children.

    ``observed_generation`` is the generation whose manifests were last applied (the
    handlers pass it; recomputing status from a child's event never advances it).
    """
    job = next((j for j in children.jobs), None)
    model_ready = topology.model.kind != "hf" or (job is not None and job.succeeded)
    download_failed = job is not None and job.failed
    by_role = {d.role: d for d in children.deployments}
    status: dict[str, Any] = {
        "observedGeneration": observed_generation,
        "url": service_url(isvc),
        "selector": topology.engine_selector,
        "prefill": None,
        "decode": None,
        "proxy": None,
    }
    role_conditions: list[dict[str, Any]] = []
    rolling = False
    degraded: list[tuple[str, str]] = []
    for role in topology.roles:
        counts, cond, is_rolling, degraded_reason = _role_state(
            role.role,
            role.replicas,
            by_role.get(role.role),
            [p for p in children.pods if p.role == role.role],
            model_ready or not role.is_engine,
        )
        status[STATUS_KEYS[role.role]] = counts
        role_conditions.append(cond)
        rolling = rolling or is_rolling
        if degraded_reason:
            degraded.append((degraded_reason, cond["message"]))
    if download_failed:
        degraded.insert(0, ("DownloadFailed", f"the model download Job {job.name} failed"))

    all_ready = (
        all(c["status"] == "True" for c in role_conditions)
        and observed_generation == isvc.metadata.generation
    )
    first_bad = next((c for c in role_conditions if c["status"] != "True"), None)
    if all_ready:
        ready = _condition("Ready", True, "AllRolesReady", "the endpoint serves the model")
    elif degraded:
        ready = _condition("Ready", False, degraded[0][0], degraded[0][1])
    elif not model_ready:
        ready = _condition("Ready", False, "DownloadingModel", f"downloading {isvc.spec.model.uri}")
    elif first_bad is not None:
        ready = _condition(
            "Ready", False, first_bad["reason"], f"{first_bad['type']}: {first_bad['message']}"
        )
    else:
        ready = _condition(
            "Ready", False, "Reconciling", "the latest spec has not been applied yet"
        )
    progressing = _condition(
        "Progressing",
        rolling and not all_ready,
        "RollingUpdate" if rolling and not all_ready else ("Complete" if all_ready else "Stalled"),
        "replicas are being created or updated"
        if rolling and not all_ready
        else ("all replicas are updated and ready" if all_ready else "no progress possible"),
    )
    degraded_cond = _condition(
        "Degraded",
        bool(degraded),
        degraded[0][0] if degraded else "AsExpected",
        degraded[0][1] if degraded else "no failures",
    )
    conditions = [ready, progressing, degraded_cond, *role_conditions]
    if autoscaler is not None:  # autoscaling.autoscaler_condition
        conditions.append(autoscaler)

    previous_conditions = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    for c in conditions:
        old = previous_conditions.get(c["type"])
        c["lastTransitionTime"] = (
            old["lastTransitionTime"]
            if old and old.get("status") == c["status"] and old.get("lastTransitionTime")
            else now
        )
        c["observedGeneration"] = observed_generation
    status["conditions"] = conditions
    if all_ready:
        status["phase"] = "Ready"
    elif degraded:
        status["phase"] = "Degraded"
    elif not model_ready:
        status["phase"] = "Downloading"
    elif not children.deployments:
        status["phase"] = "Pending"
    else:
        status["phase"] = "Progressing"
    return status


def status_changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change anything (timestamps of unchanged conditions aside)."""
    old = old or {}
    return any(old.get(k) != v for k, v in new.items() if v is not None) or any(
        old.get(k) is not None for k, v in new.items() if v is None
    )
