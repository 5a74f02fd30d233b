"""tandem.operator.status: every condition and reason a user sees, from the children's summaries.

Each case states what exists in the cluster (Deployments, pods as the kubelet or the
scheduler left them, the download Job, the cache claim, autoscalers) and checks the
conditions, the phase and the Events that come out.
"""

from __future__ import annotations

import pytest

from tandem.operator.render.manifests import render
from tandem.operator.render.meta import KV_LAYOUT_LABEL, MODEL_CACHED_ANNOTATION, cached_model_key
from tandem.operator.render.options import RenderOptions
from tandem.operator.render.pods import merge_pod_template
from tandem.operator.status.children import (
    AutoscalerSummary,
    Children,
    ClaimSummary,
    Facts,
    PodSummary,
    summarize_autoscaler,
    summarize_job,
    summarize_pod,
)
from tandem.operator.status.compute import compute_status
from tandem.operator.status.conditions import model_ready
from tandem.operator.status.events import events
from tandem.operator.topology import plan

from .utils import UID, conds, dep, healthy, isvc, message


def test_healthy_disaggregated_service_is_ready_with_model_condition() -> None:
    svc = isvc()
    status = compute_status(svc, plan(svc), healthy(svc), 1, "t0")
    assert status.phase == "Ready"
    assert conds(status)["Ready"] == ("True", "AllRolesReady")
    assert conds(status)["ModelReady"] == ("True", "Available")
    assert status.decode_selector == (
        "tandem.dev/inferenceservice=svc,app.kubernetes.io/component=engine,tandem.dev/role=decode"
    )


# ---- finding 2: Ready needs a serving path ---------------------------------------------------


def test_decode_scaled_to_zero_is_not_ready() -> None:
    svc = isvc(decode={"replicas": 0})
    status = compute_status(svc, plan(svc), healthy(svc), 1, "t0")
    assert conds(status)["Ready"] == ("False", "NoServingPath")
    assert conds(status)["DecodeReady"] == ("False", "ScaledToZero")
    assert "no decode engine is ready" in message(status, "Ready")
    assert status.phase == "Degraded"


def test_prefill_and_decode_of_different_kv_layouts_cannot_serve() -> None:
    svc = isvc()
    kids = healthy(svc)
    mixed = [
        PodSummary(p.role, True, kv_layout="old" if p.role == "prefill" else p.kv_layout)
        for p in kids.pods
    ]
    status = compute_status(svc, plan(svc), Children(kids.deployments, mixed), 1, "t0")
    assert conds(status)["Ready"] == ("False", "NoServingPath")
    assert "share a KV layout" in message(status, "Ready")


def test_no_ready_proxy_pod_is_not_ready() -> None:
    svc = isvc()
    kids = healthy(svc)
    pods = [p for p in kids.pods if p.role != "proxy"]
    status = compute_status(svc, plan(svc), Children(kids.deployments, pods), 1, "t0")
    assert conds(status)["Ready"][0] == "False"


def test_kv_layout_hash_follows_only_kv_settings() -> None:
    base = plan(isvc(engine={"blockSize": 16, "maxNumSeqs": 8})).kv_layout
    assert plan(isvc(engine={"blockSize": 16, "maxNumSeqs": 64})).kv_layout == base
    assert plan(isvc(engine={"blockSize": 32, "maxNumSeqs": 8})).kv_layout != base
    assert plan(isvc(engine={"blockSize": 16, "dtype": "float16"})).kv_layout != base
    deployment = next(
        m
        for m in render(isvc(engine={"blockSize": 16}))
        if (m["kind"], m["metadata"]["name"]) == ("Deployment", "svc-decode")
    )
    assert deployment["spec"]["template"]["metadata"]["labels"][KV_LAYOUT_LABEL] == base


# ---- finding 1: the model download tells the truth ------------------------------------------

HF = {"model": {"name": "q", "uri": "hf://org/repo", "cache": {"storageClassName": "nope"}}}


def test_unbound_cache_pvc_is_degraded_not_downloading() -> None:
    svc = isvc(**HF)
    download = PodSummary(
        "download",
        False,
        "0/2 nodes are available: pod has unbound immediate PersistentVolumeClaims. "
        "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.",
    )
    kids = Children(
        deployments=[dep("proxy", 1, 1)],
        pods=[download],
        claims=[ClaimSummary("svc-model-cache", "Pending", "nope")],
    )
    status = compute_status(svc, plan(svc), kids, 1, "t0")
    assert conds(status)["ModelReady"] == ("False", "CacheUnbound")
    assert conds(status)["Degraded"] == ("True", "CacheUnbound")
    assert conds(status)["Ready"] == ("False", "CacheUnbound")
    assert conds(status)["Progressing"][0] == "False"
    assert "svc-model-cache is not bound (storageClassName nope)" in message(status, "Ready")
    assert status.phase == "Degraded"


def test_downloading_is_progressing() -> None:
    svc = isvc(**HF)
    kids = Children(deployments=[dep("proxy", 1, 1)], pods=[PodSummary("download", False)])
    status = compute_status(svc, plan(svc), kids, 1, "t0")
    assert conds(status)["Ready"] == ("False", "DownloadingModel")
    assert conds(status)["Progressing"] == ("True", "RollingUpdate")
    assert conds(status)["Degraded"] == ("False", "AsExpected")
    assert status.phase == "Downloading"


def test_missing_credentials_secret_is_named() -> None:
    svc = isvc(model={"name": "q", "uri": "hf://org/repo", "credentialsSecret": "hf"})
    pod = summarize_pod(
        {
            "metadata": {"labels": {}},
            "status": {
                "containerStatuses": [
                    {
                        "state": {
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "hf" not found',
                            }
                        }
                    }
                ]
            },
        },
        "download",
    )
    status = compute_status(svc, plan(svc), Children(pods=[pod]), 1, "t0")
    assert conds(status)["Ready"] == ("False", "SecretMissing")
    assert 'secret "hf" not found' in message(status, "ModelReady")


def test_failed_download_job_carries_the_jobs_message() -> None:
    svc = isvc(**HF)
    job = summarize_job(
        {
            "metadata": {"name": "svc-download-1"},
            "status": {
                "conditions": [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                    }
                ]
            },
        }
    )
    status = compute_status(svc, plan(svc), Children(jobs=[job]), 1, "t0")
    assert conds(status)["Degraded"] == ("True", "DownloadFailed")
    assert "BackoffLimitExceeded Job has reached the specified backoff limit" in message(
        status, "Ready"
    )


def test_a_retained_cache_holding_the_model_is_adopted_without_a_download() -> None:
    svc = isvc(model={"name": "q", "uri": "hf://org/repo"})
    topology = plan(svc)
    claim = ClaimSummary("svc-model-cache", "Bound", cached_model=cached_model_key(topology))
    assert model_ready(svc, topology, Children(claims=[claim]))
    other = ClaimSummary("svc-model-cache", "Bound", cached_model="org/other@main")
    assert not model_ready(svc, topology, Children(claims=[other]))
    objs = render(svc, RenderOptions(model_ready=True, model_cached=True))
    assert not any(o["kind"] == "Job" for o in objs)
    pvc = next(o for o in objs if o["kind"] == "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"][MODEL_CACHED_ANNOTATION] == "org/repo@main"
    assert "ownerReferences" not in pvc["metadata"]  # cache.retain defaults to true
    owned = isvc(model={"name": "q", "uri": "hf://org/repo", "cache": {"retain": False}})
    pvc = next(o for o in render(owned) if o["kind"] == "PersistentVolumeClaim")
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == UID


# ---- pods that cannot run ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("waiting", "text", "reason"),
    [
        ("ImagePullBackOff", 'Back-off pulling image "x:1"', "ImagePullFailed"),
        ("ErrImagePull", "manifest unknown", "ImagePullFailed"),
        ("CrashLoopBackOff", "back-off 40s restarting failed container", "CrashLoopBackOff"),
        ("CreateContainerConfigError", 'secret "key" not found', "SecretMissing"),
    ],
)
def test_engine_pod_problems_are_degraded_with_the_kubelets_words(
    waiting: str, text: str, reason: str
) -> None:
    svc = isvc()
    kids = healthy(svc)
    deployments = [dep("decode", 1, 0) if d.role == "decode" else d for d in kids.deployments]
    pods = [p for p in kids.pods if p.role != "decode"]
    pods.append(PodSummary("decode", False, waiting_reason=waiting, waiting_message=text))
    status = compute_status(svc, plan(svc), Children(deployments, pods), 1, "t0")
    assert conds(status)["DecodeReady"] == ("False", reason)
    assert conds(status)["Ready"] == ("False", reason) and status.phase == "Degraded"
    assert text in message(status, "Ready")


def test_more_gpus_than_the_largest_node_is_unschedulable_at_once() -> None:
    svc = isvc(mode="Aggregated", decode={"gpus": 16})
    status = compute_status(svc, plan(svc), Children(), 1, "t0", facts=Facts(largest_node_gpus=8))
    assert conds(status)["DecodeReady"] == ("False", "Unschedulable")
    assert "needs 16 nvidia.com/gpu but the largest node has 8" in message(status, "Ready")
    # fits a node but not now: waiting for GPUs, as the scheduler says
    fits = isvc(mode="Aggregated", decode={"gpus": 8, "replicas": 3})
    kids = Children(
        deployments=[dep("both", 3, 2), dep("proxy", 1, 1)],
        pods=[PodSummary("both", False, "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")],
    )
    status = compute_status(fits, plan(fits), kids, 1, "t0", facts=Facts(largest_node_gpus=8))
    assert conds(status)["Ready"] == ("False", "WaitingForGPUs")


def test_failed_apply_shows_the_api_servers_message() -> None:
    svc = isvc()
    error = (
        'apply Deployment/svc-decode: deployments.apps "svc-decode" is forbidden: exceeded quota'
    )
    status = compute_status(svc, plan(svc), Children(), None, "t0", facts=Facts(apply_error=error))
    assert conds(status)["Ready"] == ("False", "ApplyFailed")
    assert conds(status)["Degraded"] == ("True", "ApplyFailed")
    assert message(status, "Ready") == error


def test_autoscaler_that_cannot_read_metrics_is_a_condition() -> None:
    svc = isvc(mode="Aggregated", decode={"autoscaling": {"maxReplicas": 3}})
    hpa = summarize_autoscaler(
        {
            "status": {
                "conditions": [
                    {
                        "type": "ScalingActive",
                        "status": "False",
                        "reason": "FailedGetPodsMetric",
                        "message": "unable to get metric tandem_num_requests_waiting",
                    }
                ]
            }
        },
        "both",
    )
    assert hpa == AutoscalerSummary(
        "both", False, "FailedGetPodsMetric", "unable to get metric tandem_num_requests_waiting"
    )
    kids = healthy(svc, autoscalers=[hpa])
    status = compute_status(svc, plan(svc), kids, 1, "t0")
    assert conds(status)["AutoscalingActive"] == ("False", "AutoscalingInactive")
    assert "FailedGetPodsMetric" in message(status, "AutoscalingActive")
    # it still serves: Ready, but Degraded says what is off
    assert conds(status)["Ready"][0] == "True" and conds(status)["Degraded"][0] == "True"


# ---- events -----------------------------------------------------------------------------------


def test_events_only_for_changed_conditions() -> None:
    svc = isvc()
    first = compute_status(svc, plan(svc), healthy(svc), 1, "t0")
    posted = events(None, first)
    assert ("Normal", "AllRolesReady") in {(e.type, e.reason) for e in posted}
    assert not any(e.condition == "Degraded" for e in posted)
    again = compute_status(svc, plan(svc), healthy(svc), 1, "t1", previous=first)
    assert events(first, again) == []  # a resync posts nothing
    error = "apply Deployment/svc-decode: boom"
    broken = compute_status(
        svc, plan(svc), healthy(svc), 1, "t2", previous=again, facts=Facts(apply_error=error)
    )
    warnings = [e for e in events(again, broken) if e.type == "Warning"]
    # one Event per cause (issue 31), though Degraded and RolloutComplete both carry it
    assert {c.type for c in broken.conditions if c.reason == "ApplyFailed"} >= {"Degraded"}
    assert len(warnings) == 1
    assert all(e.reason == "ApplyFailed" and error in e.message for e in warnings)


# ---- podTemplate, PDBs, defaults ----------------------------------------------------------------


def test_pod_template_is_merged_like_a_strategic_merge_patch() -> None:
    svc = isvc(
        decode={
            "podTemplate": {
                "metadata": {"labels": {"team": "a", "tandem.dev/role": "hijack"}},
                "spec": {
                    "runtimeClassName": "nvidia",
                    "schedulerName": "gang",
                    "volumes": [{"name": "extra", "emptyDir": {}}],
                    "containers": [
                        {"name": "engine", "volumeMounts": [{"name": "extra", "mountPath": "/x"}]},
                        {"name": "sidecar", "image": "busybox"},
                    ],
                },
            }
        }
    )
    deployment = next(
        m for m in render(svc) if (m["kind"], m["metadata"]["name"]) == ("Deployment", "svc-decode")
    )
    template = deployment["spec"]["template"]
    pod = template["spec"]
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["metadata"]["labels"]["tandem.dev/role"] == "decode"  # rendered wins
    assert (pod["runtimeClassName"], pod["schedulerName"]) == ("nvidia", "gang")
    assert [v["name"] for v in pod["volumes"]] == ["dshm", "extra"]
    engine, sidecar = pod["containers"]
    assert engine["args"][0] == "serve"  # merged, not replaced
    assert [m["mountPath"] for m in engine["volumeMounts"]] == ["/dev/shm", "/x"]
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    assert merge_pod_template(template, svc.spec.decode.pod_template) == template  # idempotent


def test_pdbs_let_unhealthy_pods_be_evicted_and_pods_have_requests() -> None:
    objs = render(isvc())
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == 3
    assert {p["spec"]["unhealthyPodEvictionPolicy"] for p in pdbs} == {"AlwaysAllow"}
    for d in (o for o in objs if o["kind"] == "Deployment"):
        requests = d["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), d["metadata"]["name"]


def test_gpus_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="must be 0 or a power of two"):
        isvc(decode={"gpus": 3})
    assert isvc(decode={"gpus": 4}).spec.decode.gpus == 4
