"""Each condition of the status, from the children: the model, every pool, the serving
path, the autoscalers. Pure."""

from __future__ import annotations

from ..render.meta import ADMISSION_GATE, cache_claim_name, cached_model_key
from ..spec.inference_service import InferenceService
from ..spec.roles import GPU_RESOURCE
from ..spec.status import Condition, RoleStatus
from ..topology import Topology
from .children import (
    DOWNLOAD_ROLE,
    AutoscalerSummary,
    Children,
    DeploymentSummary,
    Facts,
    PlannerReport,
    PodSummary,
)

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
        "PlannerFailing",
        "QuotaExceeded",
        "PriorityClassNotFound",
        "AdmissionRefused",
    }
)
IMAGE_PULL = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})


def model_ready(isvc: InferenceService, topology: Topology, children: Children) -> bool:
    """Whether the engines can load the model: not an hf:// model, its download Job
    succeeded, or the cache claim already holds it (a retained cache adopted)."""
    if topology.model.kind != "hf":
        return True
    if any(j.succeeded for j in children.jobs):
        return True
    claim = next((c for c in children.claims if c.name == cache_claim_name(isvc)), None)
    return claim is not None and claim.cached_model == cached_model_key(topology)


def condition(type_: str, ok: bool, reason: str, message: str) -> Condition:
    return Condition(type=type_, status="True" if ok else "False", reason=reason, message=message)


def pod_problem(pods: list[PodSummary]) -> tuple[str, str] | None:
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


def model_condition(isvc: InferenceService, topology: Topology, children: Children) -> Condition:
    if topology.model.kind != "hf":
        return condition("ModelReady", True, "Available", f"the engines load {isvc.spec.model.uri}")
    if model_ready(isvc, topology, children):
        return condition("ModelReady", True, "Downloaded", f"{isvc.spec.model.uri} is in the cache")
    claim_name = cache_claim_name(isvc)
    job = next(iter(children.jobs), None)
    if job is not None and job.failed:
        return condition(
            "ModelReady",
            False,
            "DownloadFailed",
            f"the download Job {job.name} failed: {job.message}; kubectl logs job/{job.name}",
        )
    problem = pod_problem([p for p in children.pods if p.role == DOWNLOAD_ROLE])
    if problem:
        reason, message = problem
        if reason == "CacheUnbound":
            claim = next((c for c in children.claims if c.name == claim_name), None)
            sc = claim.storage_class if claim and claim.storage_class else "(default)"
            message = f"the cache PVC {claim_name} is not bound (storageClassName {sc}): {message}"
        return condition("ModelReady", False, reason, f"model download: {message}")
    return condition("ModelReady", False, "Downloading", f"downloading {isvc.spec.model.uri}")


ROLE_CONDITIONS = {
    "prefill": "PrefillReady",
    "decode": "DecodeReady",
    "both": "DecodeReady",
    "proxy": "ProxyReady",
}


def role_condition(
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
        return counts, _not_created(type_, model_is_ready), True
    d = deployment
    counts = RoleStatus(
        desired=d.desired,
        ready=d.ready,
        updated=d.updated,
        available=d.available,
        replicas=f"{d.ready}/{d.desired}",
    )
    rolled = (
        d.observed_generation >= d.generation
        and d.updated >= d.desired
        and (d.total is None or d.total <= d.updated)  # no old pod left
    )
    if d.desired == 0:
        return counts, condition(type_, False, "ScaledToZero", "0 replicas requested"), False
    if rolled and d.ready >= d.desired:
        message = f"{d.ready}/{d.desired} replicas ready"
        return counts, condition(type_, True, "Ready", message), False
    if too_big:
        return counts, _too_big(type_, gpus, largest), False
    if any(ADMISSION_GATE in p.gates and not p.terminating for p in pods):
        message = f"{d.ready}/{d.desired} ready; {facts.held or 'waiting for gang admission'}"
        return counts, condition(type_, False, "WaitingForGPUs", message), False
    if d.replica_failure:
        message = f"{d.ready}/{d.desired} ready; the API server refused a pod: {d.replica_failure}"
        return counts, condition(type_, False, refusal_reason(d.replica_failure), message), False
    problem = pod_problem(pods)
    if problem:
        reason, message = problem
        message = f"{d.ready}/{d.desired} ready; {message}"
        return counts, condition(type_, False, reason, message), False
    if d.deadline_exceeded:
        message = f"{d.ready}/{d.desired} ready after the rollout deadline"
        return counts, condition(type_, False, "ProgressDeadlineExceeded", message), False
    if not rolled:
        message = f"{d.updated}/{d.desired} replicas updated, {d.ready} ready"
        return counts, condition(type_, False, "RollingUpdate", message), True
    message = f"{d.ready}/{d.desired} replicas ready"
    return counts, condition(type_, False, "PodsNotReady", message), True


def refusal_reason(message: str) -> str:
    """A reason of its own for each way the API server refuses a Deployment's pod."""
    if "exceeded quota" in message:
        return "QuotaExceeded"
    if "PriorityClass" in message:
        return "PriorityClassNotFound"
    return "AdmissionRefused"  # a webhook, a ValidatingAdmissionPolicy, Pod Security, ...


def _not_created(type_: str, model_is_ready: bool) -> Condition:
    """A pool whose Deployment does not exist: the engines wait for the model, else the
    operator has yet to create it."""
    if not model_is_ready:
        return condition(type_, False, "WaitingForModel", "the model is not ready")
    return condition(type_, False, "Creating", "the Deployment does not exist yet")


def _too_big(type_: str, gpus: int, largest: int | None) -> Condition:
    return condition(
        type_,
        False,
        "Unschedulable",
        f"each pod needs {gpus} {GPU_RESOURCE} but the largest node has {largest}: "
        "lower gpus or add bigger nodes",
    )


def serving_path(isvc: InferenceService, pods: list[PodSummary]) -> str | None:
    """None when a request can be served end to end; else why not. Disaggregated needs a
    ready prefill and a ready decode engine of the same KV layout behind a ready proxy."""
    # a multi-node group serves through its leader, ready once every rank has joined
    ready = [p for p in pods if p.ready and not p.terminating and not p.group_worker]
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


def autoscaling_condition(
    isvc: InferenceService, children: Children, planner: PlannerReport | None
) -> Condition | None:
    """What the autoscaling backends themselves say: an HPA's ``ScalingActive``, a KEDA
    ScaledObject's ``Ready``, the planner loop's last round. Unknown while a backend has not
    reported (a ScaledObject no KEDA controller reads stays so); None when nothing is
    autoscaled."""
    reports = [_autoscaler_report(a) for a in children.autoscalers]
    if _planned(isvc):
        reports.append(_planner_report(planner))
    if not reports:
        return None
    failing = next((r for r in reports if r[0] == "False"), None)
    if failing:
        return Condition(
            type="AutoscalingActive", status="False", reason=failing[1], message=failing[2]
        )
    silent = [r for r in reports if r[0] == "Unknown"]
    if silent:
        message = "; ".join(r[2] for r in silent)
        return Condition(
            type="AutoscalingActive", status="Unknown", reason="NotReported", message=message
        )
    message = "; ".join(r[2] for r in reports)
    return condition("AutoscalingActive", True, "ScalingActive", message)


def _planned(isvc: InferenceService) -> bool:
    roles = (isvc.spec.prefill, isvc.spec.decode)
    return any(r and r.autoscaling and r.autoscaling.backend == "Planner" for r in roles)


def _autoscaler_report(a: AutoscalerSummary) -> tuple[str, str, str]:
    """(status, reason, message) of one HPA or ScaledObject."""
    what = f"{a.role} {a.kind}"
    if a.scaling_active is None:
        controller = "KEDA's operator" if a.kind == "ScaledObject" else "the HPA controller"
        return (
            "Unknown",
            "NotReported",
            f"{what}: {controller} has not reported on it (is it running?)",
        )
    if a.scaling_active:
        return "True", "ScalingActive", f"{what}: {a.reason}: {a.message}".rstrip(": ")
    return "False", "AutoscalingInactive", f"{what}: {a.reason}: {a.message}"


def _planner_report(planner: PlannerReport | None) -> tuple[str, str, str]:
    if planner is None:
        return "Unknown", "NotReported", "the planner has not finished a round yet"
    if planner.ok:
        return "True", "ScalingActive", f"planner, last round: {planner.message}"
    return "False", "PlannerFailing", f"planner, last round: {planner.message}"


def pool_condition(children: Children) -> Condition:
    """``InferencePoolAccepted`` (``router: gateway``): whether the Gateways routing to the
    pool accepted it, as they report in its status; Unknown until one does (no Gateway routes
    to it yet). Informational: the InferenceService is Ready without it."""
    pool = children.pools[0] if children.pools else None
    if pool is None or pool.accepted is None:
        return Condition(
            type="InferencePoolAccepted",
            status="Unknown",
            reason="NoGatewayReported" if pool else "NotCreated",
            message="no Gateway has reported on the InferencePool yet",
        )
    return condition(
        "InferencePoolAccepted", pool.accepted, pool.reason or "Reported", pool.message
    )
