"""Autoscaling backends: what each renders, which specs are refused, and the health condition."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator.autoscaler.objects import demand_query, queue_query
from tandem.operator.render.manifests import render
from tandem.operator.spec.inference_service import load_inference_service
from tandem.operator.status.children import AutoscalerSummary, Children, scaled_object_health
from tandem.operator.status.compute import compute_status
from tandem.operator.topology import plan

SLO = {"ttftMs": 600, "itlMs": 25, "profileConfigMap": "llama-8b-h100"}


def isvc(**spec: Any):
    return load_inference_service(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "ml", "uid": "u1"},
            "spec": {"model": {"name": "tiny", "uri": "/models/tiny"}, **spec},
        }
    )


def kinds(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_keda_backend_renders_a_scaled_object_on_the_queue_metric() -> None:
    objs = kinds(
        render(
            isvc(
                decode={
                    "autoscaling": {
                        "backend": "KEDA",
                        "minReplicas": 1,
                        "maxReplicas": 6,
                        "targetAverageValue": "3",
                    }
                }
            )
        )
    )
    assert ("HorizontalPodAutoscaler", "svc-decode") not in objs
    so = objs[("ScaledObject", "svc-decode")]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["metadata"]["ownerReferences"][0]["name"] == "svc"
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == "svc-decode"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 6)
    [trigger] = spec["triggers"]  # no activation trigger above zero
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == queue_query("ml", "svc", "decode")
    assert 'tandem_dev_role="decode"' in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "3"
    assert "replicas" not in objs[("Deployment", "svc-decode")]["spec"]


def test_min_replicas_zero_adds_the_proxy_demand_activation_trigger() -> None:
    auto = {"backend": "KEDA", "minReplicas": 0, "maxReplicas": 4}
    so = kinds(render(isvc(decode={"autoscaling": auto})))[("ScaledObject", "svc-decode")]
    names = {t["name"]: t for t in so["spec"]["triggers"]}
    assert set(names) == {"queue", "demand"}
    assert so["spec"]["minReplicaCount"] == 0
    demand = names["demand"]["metadata"]
    assert demand["query"] == demand_query("ml", "svc")
    assert "tandem_proxy_requests_total" in demand["query"]
    assert demand["activationThreshold"] == "0"


def test_hpa_cannot_scale_to_zero() -> None:
    with pytest.raises(ValueError, match="minReplicas 0 needs backend KEDA or Planner"):
        isvc(decode={"autoscaling": {"minReplicas": 0, "maxReplicas": 3}})


def test_planner_backend_renders_no_autoscaler_and_needs_slo_on_both_pools() -> None:
    planned = {"backend": "Planner", "minReplicas": 1, "maxReplicas": 8}
    objs = kinds(
        render(isvc(slo=SLO, prefill={"autoscaling": planned}, decode={"autoscaling": planned}))
    )
    assert not [k for k in objs if k[0] in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert "replicas" not in objs[("Deployment", "svc-prefill")]["spec"]
    with pytest.raises(ValueError, match="backend Planner needs spec.slo"):
        isvc(prefill={"autoscaling": planned}, decode={"autoscaling": planned})
    with pytest.raises(ValueError, match="slo needs mode Disaggregated"):
        isvc(slo=SLO, decode={"autoscaling": planned})
    with pytest.raises(ValueError, match="slo needs mode Disaggregated"):
        isvc(mode="Aggregated", slo=SLO, decode={"autoscaling": planned})


def _so(**conds: tuple[str, str]) -> dict[str, Any]:
    return {
        "kind": "ScaledObject",
        "status": {
            "conditions": [
                {"type": t, "status": st, "reason": r, "message": f"{t} says {r}"}
                for t, (st, r) in conds.items()
            ]
        },
    }


def test_scaled_object_health_feeds_the_autoscaling_condition() -> None:
    broken = _so(Ready=("False", "ScaledObjectCheckFailed"), Active=("False", "ScalerNotActive"))
    assert scaled_object_health(broken) == (
        False,
        "ScaledObjectCheckFailed",
        "Ready says ScaledObjectCheckFailed",
    )
    idle = _so(Ready=("True", "ScaledObjectReady"), Active=("False", "ScalerNotActive"))
    assert scaled_object_health(idle)[0] is True  # at zero with no demand: healthy
    assert scaled_object_health({"kind": "ScaledObject"}) == (None, "", "")  # KEDA not there

    isvc_ = isvc(decode={"autoscaling": {"backend": "KEDA", "minReplicas": 0, "maxReplicas": 2}})
    children = Children(autoscalers=[AutoscalerSummary("decode", *scaled_object_health(broken))])
    status = compute_status(isvc_, plan(isvc_), children, 1, "2026-01-01T00:00:00Z")
    cond = next(c for c in status.conditions if c.type == "AutoscalingActive")
    assert (cond.status, cond.reason) == ("False", "AutoscalingInactive")
    assert "ScaledObjectCheckFailed" in cond.message
