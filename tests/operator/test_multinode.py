"""A replica that spans nodes (``nodesPerReplica`` > 1): the pool is a LeaderWorkerSet whose
groups are one engine each, its leader the only pod that serves; status reads the LWS in
groups and a serving path only through a ready leader."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from tandem.operator.render.manifests import render
from tandem.operator.spec.inference_service import load_inference_service
from tandem.operator.status.children import (
    Children,
    PodSummary,
    summarize_leader_worker_set,
    summarize_pod,
)
from tandem.operator.status.compute import compute_status
from tandem.operator.topology import plan
from tandem.server.api.serve_cli import add_arguments
from tandem.server.engine.engine_args import engine_config_from_args

from .utils import by_kind_name, conds, healthy, isvc

BIG = {"mode": "Aggregated", "decode": {"replicas": 2, "gpus": 8, "nodesPerReplica": 2}}


def engine(template: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == "engine")


def serve_config(args: list[str], env: dict[str, str]):
    """The EngineConfig ``tandem serve`` builds from a rendered container's args, with the
    kubelet's $(VAR) expansion of the variables LWS injects."""
    for k, v in env.items():
        args = [a.replace(f"$({k})", v) for a in args]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(args[1:])  # after "serve"
    return engine_config_from_args(parsed, parsed.model)


def test_nodes_per_replica_renders_a_leader_worker_set_not_a_deployment() -> None:
    svc = isvc(**BIG)
    objs = by_kind_name(render(svc))
    assert ("Deployment", "svc-engine") not in objs
    lws = objs[("LeaderWorkerSet", "svc-engine")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    spec = lws["spec"]
    assert spec["replicas"] == 2 and spec["startupPolicy"] == "LeaderCreated"
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = engine(group["leaderTemplate"]), engine(group["workerTemplate"])
    for c in (leader, worker):  # every pod of a group holds gpus GPUs
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    lws_env = {"LWS_LEADER_ADDRESS": "svc-engine-0.svc-engine.ml", "LWS_WORKER_INDEX": "1"}
    lead = serve_config(leader["args"], {**lws_env, "LWS_WORKER_INDEX": "0"})
    work = serve_config(worker["args"], lws_env)
    assert (lead.tensor_parallel_size, lead.nnodes, lead.node_rank) == (16, 2, 0)
    assert (work.tensor_parallel_size, work.nnodes, work.node_rank) == (16, 2, 1)
    assert lead.leader_addr == work.leader_addr == "svc-engine-0.svc-engine.ml:29500"
    assert lead.ranks_per_node == 8
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in leader["ports"]
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    assert "ports" not in worker


def test_only_the_leader_is_discovered_and_the_workers_are_fenced() -> None:
    svc = isvc(**BIG)
    topology = plan(svc)
    objs = by_kind_name(render(svc))
    group = objs[("LeaderWorkerSet", "svc-engine")]["spec"]["leaderWorkerTemplate"]
    selector = dict(kv.split("=") for kv in topology.engine_selector.split(","))
    leader_meta, worker_meta = (
        group["leaderTemplate"]["metadata"],
        group["workerTemplate"]["metadata"],
    )
    assert selector.items() <= leader_meta["labels"].items()  # the proxy finds the leader
    assert not selector.items() <= worker_meta["labels"].items()  # never a worker
    assert "tandem.dev/served-model-name" in leader_meta["annotations"]
    assert "annotations" not in worker_meta  # no model, no /metrics to scrape
    fence = objs[("NetworkPolicy", "svc-engine-workers")]["spec"]
    assert fence["podSelector"]["matchLabels"].items() <= worker_meta["labels"].items()
    assert fence["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"tandem.dev/inferenceservice": "svc"}}}]}
    ]


def test_one_node_replicas_stay_deployments_and_roles_choose_apart() -> None:
    assert not any(o["kind"] == "LeaderWorkerSet" for o in render(isvc()))
    assert ("NetworkPolicy", "svc-engine-workers") not in by_kind_name(render(isvc()))
    svc = isvc(prefill={"gpus": 4, "nodesPerReplica": 4}, decode={"gpus": 4})
    objs = by_kind_name(render(svc))
    assert ("LeaderWorkerSet", "svc-prefill") in objs
    assert ("Deployment", "svc-decode") in objs
    assert ("Deployment", "svc-prefill") not in objs


@pytest.mark.parametrize(
    ("role", "message_"),
    [
        ({"gpus": 8, "nodesPerReplica": 2, "tensorParallelSize": 8}, "times nodesPerReplica"),
        (
            {"gpus": 8, "nodesPerReplica": 2, "autoscaling": {"maxReplicas": 3}},
            "autoscaling a role with nodesPerReplica > 1 is not supported yet",
        ),
        ({"gpus": 8, "nodesPerReplica": 0}, "greater than or equal to 1"),
    ],
)
def test_a_group_that_cannot_work_is_refused(role: dict[str, Any], message_: str) -> None:
    with pytest.raises(ValueError, match=message_):
        load_inference_service(isvc_body(decode=role))


def test_tensor_parallel_size_spans_the_group() -> None:
    svc = load_inference_service(
        isvc_body(decode={"gpus": 8, "nodesPerReplica": 2, "tensorParallelSize": 16})
    )
    assert svc.spec.decode.nodes_per_replica == 2


def isvc_body(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ml"},
        "spec": {"model": {"name": "tiny", "uri": "/models/tiny"}, "mode": "Aggregated", **spec},
    }


def lws_body(replicas: int, ready: int, updated: int, total: int, updating: bool = False) -> dict:
    """A LeaderWorkerSet as LWS v0.8.0's controller leaves it: counts in groups, Available
    and Progressing exclusive, UpdateInProgress while a rollout runs, and no
    observedGeneration anywhere (makeCondition sets none)."""
    done = ready == replicas
    conditions = [
        {"type": "Available", "status": str(done), "reason": "AllGroupsReady"},
        {"type": "Progressing", "status": str(not done), "reason": "GroupsProgressing"},
    ]
    if updating:
        conditions.append(
            {"type": "UpdateInProgress", "status": "True", "reason": "GroupsUpdating"}
        )
    return {
        "metadata": {"generation": 3},
        "spec": {"replicas": replicas},
        "status": {
            "replicas": total,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": conditions,
        },
    }


def test_status_counts_groups_and_serves_only_through_a_ready_leader() -> None:
    svc = isvc(**BIG)
    layout = plan(svc).kv_layout
    base = healthy(svc)
    lws = summarize_leader_worker_set(lws_body(2, 1, 2, 2), "both")
    assert (lws.kind, lws.desired, lws.ready) == ("LeaderWorkerSet", 2, 1)
    proxy = [p for p in base.pods if p.role == "proxy"]
    worker = PodSummary("both", True, kv_layout=layout, group_worker=True)
    leader = PodSummary("both", True, kv_layout=layout)
    deployments = [d for d in base.deployments if d.role == "proxy"] + [lws]

    serving = compute_status(
        svc, plan(svc), Children(deployments, proxy + [leader, worker]), 1, "t"
    )
    assert conds(serving)["Ready"] == ("True", "AllRolesReady")
    assert conds(serving)["DecodeReady"] == ("False", "PodsNotReady")
    assert serving.decode.replicas == "1/2"  # groups, not pods

    loading = Children(deployments, proxy + [worker, PodSummary("both", False, kv_layout=layout)])
    status = compute_status(svc, plan(svc), loading, 1, "t")
    assert conds(status)["Ready"][0] == "False"  # ready workers make no serving path
    assert status.phase == "Progressing"

    done = summarize_leader_worker_set(lws_body(2, 2, 2, 2), "both")
    whole = compute_status(
        svc, plan(svc), Children(deployments[:-1] + [done], proxy + [leader]), 1, "t"
    )
    assert conds(whole)["DecodeReady"] == ("True", "Ready")
    assert conds(whole)["RolloutComplete"] == ("True", "Complete")


@pytest.mark.parametrize(
    "body",
    [
        {"metadata": {"generation": 1}, "spec": {"replicas": 2}},  # the controller never wrote
        lws_body(2, 2, 2, 2, updating=True),  # a rollout in progress, all groups still ready
    ],
    ids=["unreported", "updating"],
)
def test_an_lws_not_caught_up_is_still_rolling(body: dict) -> None:
    svc = isvc(**BIG)
    base = healthy(svc)
    deployments = [d for d in base.deployments if d.role == "proxy"]
    deployments.append(summarize_leader_worker_set(body, "both"))
    status = compute_status(svc, plan(svc), Children(deployments, base.pods), 1, "t")
    assert conds(status)["DecodeReady"] == ("False", "RollingUpdate")
    assert conds(status)["Ready"][0] == "True"  # the leader serves meanwhile


def test_a_worker_pod_is_told_apart_by_its_component() -> None:
    labels = {"app.kubernetes.io/component": "engine-worker", "tandem.dev/role": "both"}
    pod = {"metadata": {"name": "w", "labels": labels}, "spec": {}, "status": {}}
    assert summarize_pod(pod, "both").group_worker
    labels["app.kubernetes.io/component"] = "engine"
    assert not summarize_pod(pod, "both").group_worker


def test_the_crd_refuses_a_pool_changing_kind_on_update() -> None:
    """A transition rule (the API server alone sees the old object): 1 <-> more than 1."""
    from tandem.operator.crd import crd

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for role in ("prefill", "decode"):
        field = spec["properties"][role]["properties"]["nodesPerReplica"]
        assert field["default"] == 1
        assert field["x-kubernetes-validations"][0]["rule"] == "(self == 1) == (oldSelf == 1)"
