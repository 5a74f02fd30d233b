"""Helpers for the operator's tests: an InferenceService as the API server hands it over."""

from __future__ import annotations

from typing import Any

from tandem.operator.spec.inference_service import load_inference_service
from tandem.operator.status.children import Children, DeploymentSummary, PodSummary
from tandem.operator.topology import plan

UID = "0b5a6e0e-6f5b-4a57-9d55-7a0f4d8f3c11"


def isvc(generation: int = 1, **spec: Any):
    body = {"model": {"name": "tiny", "uri": "/models/tiny"}, **spec}
    return load_inference_service(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "ml", "uid": UID, "generation": generation},
            "spec": body,
        }
    )


def by_kind_name(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def dep(role: str, desired: int, ready: int) -> DeploymentSummary:
    return DeploymentSummary(role, 1, 1, desired, ready, desired, ready)


def ready_pods(role: str, n: int, layout: str | None = None) -> list[PodSummary]:
    return [PodSummary(role, True, kv_layout=layout) for _ in range(n)]


def healthy(svc, **overrides: Any) -> Children:
    """Every role of ``svc`` fully ready, with its pods, then the overrides."""
    layout = plan(svc).kv_layout
    deployments, pods = [], []
    for role in plan(svc).roles:
        deployments.append(dep(role.role, role.replicas, role.replicas))
        pods += ready_pods(role.role, role.replicas, layout if role.is_engine else None)
    return Children(**{"deployments": deployments, "pods": pods, **overrides})


def conds(status) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def message(status, type_: str) -> str:
    return next(c.message for c in status.conditions if c.type == type_)
