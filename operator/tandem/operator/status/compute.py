"""The whole status of an InferenceService from its children, and its round trip through
the API server (a merge patch out, the stored status back). Pure."""

from __future__ import annotations

from typing import Any

from ..render.meta import ROLE_LABEL, service_url
from ..spec.inference_service import InferenceService
from ..spec.status import Condition, InferenceServiceStatus, LoraStatus, RoleStatus
from ..topology import Topology
from .children import Children, Facts
from .conditions import (
    FAILURES,
    ROLE_CONDITIONS,
    autoscaling_condition,
    condition,
    model_condition,
    pool_condition,
    role_condition,
    serving_path,
)

STATUS_KEYS = {"prefill": "prefill", "decode": "decode", "both": "decode", "proxy": "proxy"}


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

    ``Ready`` means a request can be served now (a serving path exists), whatever a rollout
    or a scale-up is doing; ``RolloutComplete`` and ``Progressing`` say how far the latest
    spec is rolled out; ``Degraded`` says what will not fix itself; a pool its autoscaler
    scaled to zero is ``Idle``, not a failure.
    """
    model = model_condition(isvc, topology, children)
    model_is_ready = model.status == "True"
    roles, role_conditions, rolling = _pools(topology, children, model_is_ready, facts)
    rolling = rolling or (not model_is_ready and model.reason == "Downloading")
    autoscaling = autoscaling_condition(isvc, children, facts.planner)
    idle = _idle(topology, children)
    no_path = serving_path(isvc, children.pods)
    failures, complete = _failures(
        isvc, children, observed_generation, facts, model, role_conditions, idle, no_path
    )
    if autoscaling is not None and autoscaling.reason in FAILURES:
        failures.append(autoscaling)
    serving = no_path is None
    conditions = [
        _ready(serving, no_path, idle, failures, model, role_conditions),
        _progressing(rolling and not complete and not failures, complete),
        _rollout_complete(complete, failures),
        _degraded(failures),
        model,
        *role_conditions,
    ]
    if autoscaling is not None:
        conditions.append(autoscaling)
    if topology.router == "gateway":
        conditions.append(pool_condition(children))
    decode_role = topology.role("decode") or topology.role("both")
    return InferenceServiceStatus(
        observed_generation=observed_generation,
        phase=_phase(serving, idle, failures, model_is_ready, children),
        url=service_url(isvc) if topology.router == "proxy" else None,  # else the Gateway's
        selector=topology.engine_selector,
        decode_selector=f"{topology.engine_selector},{ROLE_LABEL}={decode_role.role}"
        if decode_role
        else None,
        loras=[
            LoraStatus(name=lora.name, uri=lora.uri, path=path)
            for lora, (_, path) in zip(isvc.spec.loras, topology.loras, strict=True)
        ],
        conditions=_stamp(conditions, previous, now, observed_generation),
        **roles,
    )


def _pools(
    topology: Topology, children: Children, model_is_ready: bool, facts: Facts
) -> tuple[dict[str, RoleStatus | None], list[Condition], bool]:
    """Each pool's counts (by status key) and condition, and whether any pool is rolling."""
    by_role = {d.role: d for d in children.deployments}
    roles: dict[str, RoleStatus | None] = {"prefill": None, "decode": None, "proxy": None}
    role_conditions: list[Condition] = []
    rolling = False
    for role in topology.roles:
        counts, cond, is_rolling = role_condition(
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
    return roles, role_conditions, rolling


def _idle(topology: Topology, children: Children) -> list[str]:
    """The engine pools that their autoscaler (KEDA or the planner, minReplicas 0) has
    scaled to zero: the documented scale-to-zero, not a failure."""
    by_role = {d.role: d for d in children.deployments}
    return [
        r.role
        for r in topology.engines
        if r.autoscaling is not None
        and r.autoscaling.min_replicas == 0
        and r.role in by_role
        and by_role[r.role].desired == 0
    ]


def _failures(
    isvc: InferenceService,
    children: Children,
    observed_generation: int | None,
    facts: Facts,
    model: Condition,
    role_conditions: list[Condition],
    idle: list[str],
    no_path: str | None,
) -> tuple[list[Condition], bool]:
    """(what keeps the service from serving or rolling out and will not fix itself, the one
    Ready reports first; whether the latest spec is wholly rolled out)."""
    failures: list[Condition] = []
    if facts.apply_error:
        failures.append(condition("Applied", False, "ApplyFailed", facts.apply_error))
    failures += [c for c in (model, *role_conditions) if c.reason in FAILURES]
    applied = observed_generation == isvc.metadata.generation and not facts.apply_error
    idle_types = {ROLE_CONDITIONS[r] for r in idle}
    settled = [c for c in role_conditions if c.type not in idle_types]
    roles_ready = all(c.status == "True" for c in settled) and model.status == "True"
    if roles_ready and applied and no_path and not idle:
        failures.append(condition("Ready", False, "NoServingPath", no_path))
    elif any(c.reason == "ScaledToZero" for c in settled) and not failures:
        message = no_path or "a pool has 0 replicas"
        failures.append(condition("Ready", False, "NoServingPath", message))
    return failures, roles_ready and applied and (no_path is None or bool(idle))


def _ready(
    serving: bool,
    no_path: str | None,
    idle: list[str],
    failures: list[Condition],
    model: Condition,
    role_conditions: list[Condition],
) -> Condition:
    """``Ready``: whether a serving path exists; when not, the first reason to look at."""
    if serving:
        return condition("Ready", True, "AllRolesReady", "the endpoint serves the model")
    if failures:
        return condition("Ready", False, failures[0].reason, failures[0].message)
    if idle:
        message = f"scaled to zero by its autoscaler ({', '.join(idle)}); the next request wakes it"
        return condition("Ready", False, "Idle", message)
    if model.status != "True":
        return condition("Ready", False, "DownloadingModel", model.message)
    first_bad = next((c for c in role_conditions if c.status != "True"), None)
    if first_bad is not None:
        message = f"{first_bad.type}: {first_bad.message}"
        return condition("Ready", False, first_bad.reason, message)
    message = no_path or "the latest spec has not been applied yet"
    return condition("Ready", False, "Reconciling", message)


def _progressing(progressing_now: bool, complete: bool) -> Condition:
    return condition(
        "Progressing",
        progressing_now,
        "RollingUpdate" if progressing_now else ("Complete" if complete else "Stalled"),
        "replicas are being created, downloaded or updated"
        if progressing_now
        else ("all replicas are updated and ready" if complete else "waiting on a failure"),
    )


def _rollout_complete(complete: bool, failures: list[Condition]) -> Condition:
    """Like a Deployment's rollout status: the latest spec is applied and every pool has
    its replicas updated and ready (``kubectl wait --for=condition=RolloutComplete``)."""
    if complete:
        return condition("RolloutComplete", True, "Complete", "every pool runs the latest spec")
    if failures:
        return condition("RolloutComplete", False, failures[0].reason, failures[0].message)
    return condition("RolloutComplete", False, "RollingUpdate", "the latest spec is rolling out")


def _degraded(failures: list[Condition]) -> Condition:
    return condition(
        "Degraded",
        bool(failures),
        failures[0].reason if failures else "AsExpected",
        failures[0].message if failures else "no failures",
    )


def _phase(
    serving: bool,
    idle: list[str],
    failures: list[Condition],
    model_is_ready: bool,
    children: Children,
) -> str:
    if serving:
        return "Ready"
    if failures:
        return "Degraded"
    if idle:
        return "Idle"
    if not model_is_ready:
        return "Downloading"
    if not children.deployments:
        return "Pending"
    return "Progressing"


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
