"""Children -> status. Pure: the one place that decides what an InferenceService's status is.

The handlers feed it summaries of what exists (Deployments, Pods, Jobs, the cache claim,
autoscalers) and two facts of their own (the last apply's error, the largest node's GPUs);
it returns a typed :class:`~tandem.operator.spec.InferenceServiceStatus`. Whether the model
is ready, whether the service can serve, and which events to post are decided here and
nowhere else, so the handlers never compute readiness a second way.

Status is recomputed whole every time from the children (level-based), never accumulated,
so an operator restart or a missed event cannot leave it stale. Only a condition's
``lastTransitionTime`` is carried over from the previous status, when its value is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .render.meta import (
    KV_LAYOUT_LABEL,
    MODEL_CACHED_ANNOTATION,
    ROLE_LABEL,
    cache_claim_name,
    cached_model_key,
    service_url,
)
from .spec.inference_service import InferenceService
from .spec.roles import GPU_RESOURCE
from .spec.status import Condition, InferenceServiceStatus, RoleStatus
from .topology import Topology

DOWNLOAD_ROLE = "download"

# Reasons that mean "something is wrong that will not fix itself": Degraded=True, a Warning event.
FAILURES = frozenset(
    {
        "ApplyFailed",
        "CacheUnbound",
        "SecretMissing",
        "ImagePullFailed",
        "ConfigError",
        "CrashLoopBackOff",
        "DownloadFailed",
        "Unschedulable",
        "WaitingForGPUs",
        "WaitingForGang",
        "ProgressDeadlineExceeded",
        "NoServingPath",
        "AutoscalingInactive",
    }
)
IMAGE_PULL = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})


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
    unschedulable: str | None = None
    """The scheduler's message when PodScheduled=False/Unschedulable."""
    waiting_reason: str | None = None
    """e.g. CrashLoopBackOff, ImagePullBackOff, CreateContainerConfigError."""
    terminating: bool = False
    waiting_message: str = ""
    kv_layout: str | None = None


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
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class Children:
    """An InferenceService's children; ``jobs`` holds only the current spec's download Job."""

    deployments: list[DeploymentSummary] = field(default_factory=list)
    pods: list[PodSummary] = field(default_factory=list)
    jobs: list[JobSummary] = field(default_factory=list)
    claims: list[ClaimSummary] = field(default_factory=list)
    autoscalers: list[AutoscalerSummary] = field(default_factory=list)


@dataclass(frozen=True)
class Facts:
    """What the operator itself knows, beside the children."""

    apply_error: str | None = None
    """The API server's message when the last apply failed."""
    largest_node_gpus: int | None = None
    """The most GPUs any node has allocatable (None: nodes not known yet)."""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    condition: str
    status: str


# ---- summaries of children's bodies --------------------------------------------------------------


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
    )


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
    )


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
    """(able to scale, reason, message) of a ScaledObject, as ``status.AutoscalerSummary``
    takes them for an HPA's ``ScalingActive``: its ``Ready`` condition says whether KEDA
    resolved its triggers and target. None while KEDA has not reported (or does not run).
    An inactive ScaledObject (a pool at zero with no demand) is healthy."""
    conditions = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    ready = conditions.get("Ready")
    if ready is None or ready.get("status") == "Unknown":
        return None, "", ""
    ok = ready.get("status") == "True"
    return (
        ok,
        ready.get("reason") or ("ScaledObjectReady" if ok else "ScaledObjectNotReady"),
        (ready.get("message") or ""),
    )


# ---- decisions -------------------------------------------------------------------------------


def model_ready(isvc: InferenceService, topology: Topology, children: Children) -> bool:
    """Whether the engines can load the model: not an hf:// model, its download Job
    succeeded, or the cache claim already holds it (a retained cache adopted)."""
    if topology.model.kind != "hf":
        return True
    if any(j.succeeded for j in children.jobs):
        return True
    claim = next((c for c in children.claims if c.name == cache_claim_name(isvc)), None)
    return claim is not None and claim.cached_model == cached_model_key(topology)


def _cond(type_: str, ok: bool, reason: str, message: str) -> Condition:
    return Condition(type=type_, status="True" if ok else "False", reason=reason, message=message)


def _pod_problem(pods: list[PodSummary]) -> tuple[str, str] | None:
    """(reason, message) of the first pod that cannot run, from the kubelet's or scheduler's words."""
    for p in pods:
        if p.terminating:
            continue
        if p.unschedulable:
            reason = "WaitingForGPUs" if GPU_RESOURCE in p.unschedulable else "Unschedulable"
            if "PersistentVolumeClaim" in p.unschedulable:
                reason = "CacheUnbound"
            elif "pod group" in p.unschedulable:
                reason = "WaitingForGang"  # its other members cannot be placed with it
            return reason, p.unschedulable
        if p.waiting_reason in IMAGE_PULL:
            return "ImagePullFailed", f"{p.waiting_reason}: {p.waiting_message}".rstrip(": ")
        if p.waiting_reason == "CreateContainerConfigError":
            reason = "SecretMissing" if "secret" in p.waiting_message.lower() else "ConfigError"
            return reason, p.waiting_message or p.waiting_reason
        if p.waiting_reason == "CreateContainerError":
            return "ConfigError", p.waiting_message or p.waiting_reason
        if p.waiting_reason == "CrashLoopBackOff":
            return "CrashLoopBackOff", p.waiting_message or "a container keeps exiting"
    return None


def _model_condition(isvc: InferenceService, topology: Topology, children: Children) -> Condition:
    if topology.model.kind != "hf":
        return _cond("ModelReady", True, "Available", f"the engines load {isvc.spec.model.uri}")
    if model_ready(isvc, topology, children):
        return _cond("ModelReady", True, "Downloaded", f"{isvc.spec.model.uri} is in the cache")
    claim_name = cache_claim_name(isvc)
    job = next(iter(children.jobs), None)
    if job is not None and job.failed:
        return _cond(
            "ModelReady",
            False,
            "DownloadFailed",
            f"the download Job {job.name} failed: {job.message}; kubectl logs job/{job.name}",
        )
    problem = _pod_problem([p for p in children.pods if p.role == DOWNLOAD_ROLE])
    if problem:
        reason, message = problem
        if reason == "CacheUnbound":
            claim = next((c for c in children.claims if c.name == claim_name), None)
            sc = claim.storage_class if claim and claim.storage_class else "(default)"
            message = f"the cache PVC {claim_name} is not bound (storageClassName {sc}): {message}"
        return _cond("ModelReady", False, reason, f"model download: {message}")
    return _cond("ModelReady", False, "Downloading", f"downloading {isvc.spec.model.uri}")


ROLE_CONDITIONS = {
    "prefill": "PrefillReady",
    "decode": "DecodeReady",
    "both": "DecodeReady",
    "proxy": "ProxyReady",
}
STATUS_KEYS = {"prefill": "prefill", "decode": "decode", "both": "decode", "proxy": "proxy"}


def _role(
    role: str,
    gpus: int,
    desired_replicas: int,
    deployment: DeploymentSummary | None,
    pods: list[PodSummary],
    model_is_ready: bool,
    facts: Facts,
) -> tuple[RoleStatus, Condition, bool]:
    """(role status, role condition, rolling?) for one pool."""
    type_ = ROLE_CONDITIONS[role]
    largest = facts.largest_node_gpus
    too_big = gpus > 0 and largest is not None and gpus > largest
    if deployment is None:
        counts = RoleStatus(desired=desired_replicas, replicas=f"0/{desired_replicas}")
        if too_big:
            return counts, _too_big(type_, gpus, largest), False
        if not model_is_ready:
            return counts, _cond(type_, False, "WaitingForModel", "the model is not ready"), True
        return counts, _cond(type_, False, "Creating", "the Deployment does not exist yet"), True
    d = deployment
    counts = RoleStatus(
        desired=d.desired,
        ready=d.ready,
        updated=d.updated,
        available=d.available,
        replicas=f"{d.ready}/{d.desired}",
    )
    rolled = d.observed_generation >= d.generation and d.updated >= d.desired
    if d.desired == 0:
        return counts, _cond(type_, False, "ScaledToZero", "0 replicas requested"), False
    if rolled and d.ready >= d.desired:
        return counts, _cond(type_, True, "Ready", f"{d.ready}/{d.desired} replicas ready"), False
    if too_big:
        return counts, _too_big(type_, gpus, largest), False
    problem = _pod_problem(pods)
    if problem:
        reason, message = problem
        return counts, _cond(type_, False, reason, f"{d.ready}/{d.desired} ready; {message}"), False
    if d.deadline_exceeded:
        message = f"{d.ready}/{d.desired} ready after the rollout deadline"
        return counts, _cond(type_, False, "ProgressDeadlineExceeded", message), False
    if not rolled:
        message = f"{d.updated}/{d.desired} replicas updated, {d.ready} ready"
        return counts, _cond(type_, False, "RollingUpdate", message), True
    message = f"{d.ready}/{d.desired} replicas ready"
    return counts, _cond(type_, False, "PodsNotReady", message), True


def _too_big(type_: str, gpus: int, largest: int | None) -> Condition:
    return _cond(
        type_,
        False,
        "Unschedulable",
        f"each pod needs {gpus} {GPU_RESOURCE} but the largest node has {largest}: "
        "lower gpus or add bigger nodes",
    )


def serving_path(isvc: InferenceService, pods: list[PodSummary]) -> str | None:
    """None when a request can be served end to end; else why not. Disaggregated needs a
    ready prefill and a ready decode engine of the same KV layout behind a ready proxy."""
    ready = [p for p in pods if p.ready and not p.terminating]
    if isvc.spec.mode == "Aggregated":
        if not any(p.role == "both" for p in ready):
            return "no engine pod is ready"
    else:
        prefill = {p.kv_layout for p in ready if p.role == "prefill"}
        decode = {p.kv_layout for p in ready if p.role == "decode"}
        if not prefill or not decode:
            missing = "decode" if not decode else "prefill"
            return f"no {missing} engine is ready: a disaggregated service needs both"
        if not prefill & decode:
            return "no ready prefill and decode engines share a KV layout (a rollout is half-way)"
    return None if any(p.role == "proxy" for p in ready) else "no proxy pod is ready"


def _autoscaling_condition(children: Children) -> Condition | None:
    if not children.autoscalers:
        return None
    bad = next((a for a in children.autoscalers if a.scaling_active is False), None)
    if bad:
        return _cond(
            "AutoscalingActive",
            False,
            "AutoscalingInactive",
            f"{bad.role} autoscaler: {bad.reason}: {bad.message}",
        )
    return _cond("AutoscalingActive", True, "ScalingActive", "the autoscalers can read metrics")


def compute_status(
    isvc: InferenceService,
    topology: Topology,
    children: Children,
    observed_generation: int | None,
    now: str,
    previous: InferenceServiceStatus | None = None,
    facts: Facts = Facts(),
) -> InferenceServiceStatus:
    """The whole ``status`` of an InferenceService from its children.

    ``observed_generation`` is the generation whose manifests were last applied (the
    handlers pass it; recomputing status from a child's event never advances it).
    """
    model = _model_condition(isvc, topology, children)
    model_is_ready = model.status == "True"
    by_role = {d.role: d for d in children.deployments}
    roles: dict[str, RoleStatus | None] = {"prefill": None, "decode": None, "proxy": None}
    role_conditions: list[Condition] = []
    rolling = not model_is_ready and model.reason == "Downloading"
    for role in topology.roles:
        counts, cond, is_rolling = _role(
            role.role,
            role.gpus,
            role.replicas,
            by_role.get(role.role),
            [p for p in children.pods if p.role == role.role],
            model_is_ready or not role.is_engine,
            facts,
        )
        roles[STATUS_KEYS[role.role]] = counts
        role_conditions.append(cond)
        rolling = rolling or is_rolling
    autoscaling = _autoscaling_condition(children)

    failures: list[Condition] = []
    if facts.apply_error:
        failures.append(_cond("Applied", False, "ApplyFailed", facts.apply_error))
    failures += [c for c in (model, *role_conditions) if c.reason in FAILURES]
    applied = observed_generation == isvc.metadata.generation and not facts.apply_error
    roles_ready = all(c.status == "True" for c in role_conditions) and model_is_ready
    no_path = serving_path(isvc, children.pods)
    if roles_ready and applied and no_path:
        failures.append(_cond("Ready", False, "NoServingPath", no_path))
    elif any(c.reason == "ScaledToZero" for c in role_conditions) and not failures:
        failures.append(_cond("Ready", False, "NoServingPath", no_path or "a pool has 0 replicas"))
    all_ready = roles_ready and applied and no_path is None
    if autoscaling is not None and autoscaling.status == "False":
        failures.append(autoscaling)

    first_bad = next((c for c in role_conditions if c.status != "True"), None)
    if all_ready:
        ready = _cond("Ready", True, "AllRolesReady", "the endpoint serves the model")
    elif failures:
        ready = _cond("Ready", False, failures[0].reason, failures[0].message)
    elif not model_is_ready:
        ready = _cond("Ready", False, "DownloadingModel", model.message)
    elif first_bad is not None:
        ready = _cond("Ready", False, first_bad.reason, f"{first_bad.type}: {first_bad.message}")
    else:
        ready = _cond("Ready", False, "Reconciling", "the latest spec has not been applied yet")
    progressing_now = rolling and not all_ready and not failures
    progressing = _cond(
        "Progressing",
        progressing_now,
        "RollingUpdate" if progressing_now else ("Complete" if all_ready else "Stalled"),
        "replicas are being created, downloaded or updated"
        if progressing_now
        else ("all replicas are updated and ready" if all_ready else "waiting on a failure"),
    )
    degraded = _cond(
        "Degraded",
        bool(failures),
        failures[0].reason if failures else "AsExpected",
        failures[0].message if failures else "no failures",
    )
    conditions = [ready, progressing, degraded, model, *role_conditions]
    if autoscaling is not None:
        conditions.append(autoscaling)
    conditions = _stamp(conditions, previous, now, observed_generation)

    if all_ready:
        phase = "Ready"
    elif failures:
        phase = "Degraded"
    elif not model_is_ready:
        phase = "Downloading"
    elif not children.deployments:
        phase = "Pending"
    else:
        phase = "Progressing"
    decode_role = topology.role("decode") or topology.role("both")
    return InferenceServiceStatus(
        observed_generation=observed_generation,
        phase=phase,
        url=service_url(isvc),
        selector=topology.engine_selector,
        decode_selector=f"{topology.engine_selector},{ROLE_LABEL}={decode_role.role}"
        if decode_role
        else None,
        conditions=conditions,
        **roles,
    )


def _stamp(
    conditions: list[Condition],
    previous: InferenceServiceStatus | None,
    now: str,
    observed_generation: int | None,
) -> list[Condition]:
    old = {c.type: c for c in previous.conditions} if previous else {}
    out = []
    for c in conditions:
        before = old.get(c.type)
        kept = before and before.status == c.status and before.last_transition_time
        out.append(
            c.model_copy(
                update={
                    "last_transition_time": before.last_transition_time if kept else now,
                    "observed_generation": observed_generation,
                }
            )
        )
    return out


def as_patch(status: InferenceServiceStatus) -> dict[str, Any]:
    """The status as a merge patch: camelCase, and absent roles as null (so they are removed)."""
    return status.model_dump(by_alias=True, exclude_none=False)


def parse_status(data: dict[str, Any] | None) -> InferenceServiceStatus | None:
    """The stored status, or None when there is none yet or it predates this schema."""
    if not data:
        return None
    try:
        return InferenceServiceStatus.model_validate(data)
    except ValueError:
        return None


def status_changed(old: InferenceServiceStatus | None, new: InferenceServiceStatus) -> bool:
    """Whether writing ``new`` would change anything."""
    return old != new


def events(old: InferenceServiceStatus | None, new: InferenceServiceStatus) -> list[Event]:
    """One event per condition whose status or reason changed: resyncs that change nothing
    post nothing. A failure reason is a Warning."""
    before = {c.type: (c.status, c.reason) for c in old.conditions} if old else {}
    out = []
    for c in new.conditions:
        if before.get(c.type) == (c.status, c.reason):
            continue
        if c.type == "Degraded" and c.status == "False" and c.type not in before:
            continue  # "no failures" on creation says nothing
        kind: Literal["Normal", "Warning"] = "Warning" if c.reason in FAILURES else "Normal"
        out.append(Event(kind, c.reason, f"{c.type}={c.status}: {c.message}", c.type, c.status))
    return out
