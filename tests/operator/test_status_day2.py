"""Issue 31's status, from children as the API server and the controllers leave them: what
Kubernetes already says (ReplicaFailure, pod statuses) with a reason of its own; Ready as
"a serving path exists", rollout progress apart; scale-to-zero as Idle; the autoscaling
backends' own state; one Event per cause."""

from __future__ import annotations

import pytest

from tandem.operator.status.children import (
    AutoscalerSummary,
    Children,
    DeploymentSummary,
    Facts,
    PlannerReport,
    PodSummary,
    summarize_deployment,
)
from tandem.operator.status.compute import compute_status
from tandem.operator.status.events import events
from tandem.operator.topology import plan

from .utils import conds, dep, healthy, isvc, message, ready_pods

QUOTA = (
    'pods "svc-decode-7d9f-abcde" is forbidden: exceeded quota: gpus, requested: '
    "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=0, limited: requests.nvidia.com/gpu=0"
)
PRIORITY = 'pods "svc-decode-7d9f-abcde" is forbidden: no PriorityClass with name urgent was found'
WEBHOOK = 'admission webhook "deny.example.com" denied the request: no GPUs on Fridays'


def _refused(message: str) -> DeploymentSummary:
    """A Deployment as the controller leaves it when the API server refuses its pods."""
    body = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 1,
            "conditions": [
                {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
                {
                    "type": "ReplicaFailure",
                    "status": "True",
                    "reason": "FailedCreate",
                    "message": message,
                },
            ],
        },
    }
    return summarize_deployment(body, "decode")


@pytest.mark.parametrize(
    ("refusal", "reason"),
    [(QUOTA, "QuotaExceeded"), (PRIORITY, "PriorityClassNotFound"), (WEBHOOK, "AdmissionRefused")],
)
def test_refused_pods_are_degraded_at_once_with_the_api_servers_words(
    refusal: str, reason: str
) -> None:
    svc = isvc()
    kids = healthy(svc)
    deployments = [_refused(refusal) if d.role == "decode" else d for d in kids.deployments]
    pods = [p for p in kids.pods if p.role != "decode"]
    status = compute_status(svc, plan(svc), Children(deployments, pods), 1, "t0")
    assert conds(status)["DecodeReady"] == ("False", reason)
    assert conds(status)["Ready"] == ("False", reason)
    assert conds(status)["Degraded"] == ("True", reason)
    assert conds(status)["Progressing"][0] == "False" and status.phase == "Degraded"
    assert refusal in message(status, "Ready")
    warnings = [e for e in events(None, status) if e.type == "Warning"]
    assert [(e.reason, e.condition) for e in warnings] == [(reason, "DecodeReady")]


def test_a_serving_service_stays_ready_through_a_scale_up_and_a_rollout() -> None:
    svc = isvc(decode={"replicas": 4})
    kids = healthy(svc)
    layout = plan(svc).kv_layout
    scaling = [
        DeploymentSummary("decode", 2, 2, 4, 2, 2, 2) if d.role == "decode" else d
        for d in kids.deployments
    ]
    pods = [p for p in kids.pods if p.role != "decode"] + ready_pods("decode", 2, layout)
    status = compute_status(svc, plan(svc), Children(scaling, pods), 1, "t0")
    assert conds(status)["Ready"] == ("True", "AllRolesReady")
    assert conds(status)["DecodeReady"] == ("False", "RollingUpdate")
    assert conds(status)["Progressing"] == ("True", "RollingUpdate")
    assert conds(status)["RolloutComplete"] == ("False", "RollingUpdate")
    assert conds(status)["Degraded"] == ("False", "AsExpected") and status.phase == "Ready"
    done = compute_status(svc, plan(svc), healthy(svc), 1, "t1", previous=status)
    assert conds(done)["RolloutComplete"] == ("True", "Complete")
    assert events(status, done) == []  # Ready never changed: nothing to post


def test_one_crash_looping_replica_of_a_serving_pool_is_degraded_not_unready() -> None:
    svc = isvc(decode={"replicas": 2})
    kids = healthy(svc)
    layout = plan(svc).kv_layout
    deployments = [dep("decode", 2, 1) if d.role == "decode" else d for d in kids.deployments]
    pods = [p for p in kids.pods if p.role != "decode"] + [
        PodSummary("decode", True, kv_layout=layout),
        PodSummary("decode", False, waiting_reason="CrashLoopBackOff", kv_layout=layout),
    ]
    status = compute_status(svc, plan(svc), Children(deployments, pods), 1, "t0")
    assert conds(status)["Ready"][0] == "True"
    assert conds(status)["Degraded"] == ("True", "CrashLoopBackOff")


KEDA_ZERO = {"autoscaling": {"backend": "KEDA", "minReplicas": 0, "maxReplicas": 2}}


def test_scale_to_zero_by_the_autoscaler_is_idle_not_degraded() -> None:
    svc = isvc(mode="Aggregated", decode=KEDA_ZERO)
    ready = AutoscalerSummary("both", True, "ScaledObjectReady", "inactive", "ScaledObject")
    kids = Children(
        deployments=[dep("both", 0, 0), dep("proxy", 1, 1)],
        pods=ready_pods("proxy", 1),
        autoscalers=[ready],
    )
    status = compute_status(svc, plan(svc), kids, 1, "t0")
    assert conds(status)["Ready"] == ("False", "Idle") and status.phase == "Idle"
    assert conds(status)["Degraded"] == ("False", "AsExpected")
    assert conds(status)["RolloutComplete"] == ("True", "Complete")
    assert conds(status)["AutoscalingActive"] == ("True", "ScalingActive")
    woken = Children(
        deployments=[dep("both", 1, 1), dep("proxy", 1, 1)],
        pods=ready_pods("proxy", 1) + ready_pods("both", 1, plan(svc).kv_layout),
        autoscalers=[ready],
    )
    serving = compute_status(svc, plan(svc), woken, 1, "t0")
    assert conds(serving)["Ready"] == ("True", "AllRolesReady")
    posted = events(serving, compute_status(svc, plan(svc), kids, 1, "t1", previous=serving))
    assert [(e.type, e.reason) for e in posted] == [("Normal", "Idle")]


def test_a_scaled_object_no_keda_reads_is_not_reported_as_active() -> None:
    svc = isvc(mode="Aggregated", decode=KEDA_ZERO)
    silent = AutoscalerSummary("both", None, kind="ScaledObject")
    status = compute_status(svc, plan(svc), healthy(svc, autoscalers=[silent]), 1, "t0")
    assert conds(status)["AutoscalingActive"] == ("Unknown", "NotReported")
    assert "KEDA's operator has not reported" in message(status, "AutoscalingActive")


PLANNED = {
    "slo": {"ttftMs": 500, "itlMs": 50, "profileConfigMap": "p"},
    "prefill": {"autoscaling": {"backend": "Planner", "minReplicas": 1, "maxReplicas": 4}},
    "decode": {"autoscaling": {"backend": "Planner", "minReplicas": 1, "maxReplicas": 4}},
}


def test_a_planner_that_cannot_reach_its_metrics_is_a_condition() -> None:
    svc = isvc(**PLANNED)
    status = compute_status(svc, plan(svc), healthy(svc), 1, "t0")
    assert conds(status)["AutoscalingActive"] == ("Unknown", "NotReported")
    failing = PlannerReport(False, "URLError: <urlopen error [Errno 111] Connection refused>")
    status = compute_status(svc, plan(svc), healthy(svc), 1, "t1", facts=Facts(planner=failing))
    assert conds(status)["AutoscalingActive"] == ("False", "PlannerFailing")
    assert conds(status)["Degraded"] == ("True", "PlannerFailing")
    assert conds(status)["Ready"][0] == "True"  # it serves; it just does not scale
    assert "Connection refused" in message(status, "AutoscalingActive")
    fine = PlannerReport(True, "sized 1 prefill, 1 decode for the SLO")
    status = compute_status(svc, plan(svc), healthy(svc), 1, "t2", facts=Facts(planner=fine))
    assert conds(status)["AutoscalingActive"] == ("True", "ScalingActive")
