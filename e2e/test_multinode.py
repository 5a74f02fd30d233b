"""Issue 31 item 6, a replica that spans nodes, on the real control plane: with LWS's
LeaderWorkerSet CRD generated from its Go module (``e2e/cluster/crdgen``), an
InferenceService whose pool has ``nodesPerReplica: 2`` gets a LeaderWorkerSet the API server
accepts as rendered (structural schema, no field pruned), under the chart's RBAC; status
follows the LWS in groups and serves only through a ready leader; going back to one node, or
deleting the service, removes it.

No LWS controller runs here (nor its webhook): the test does what it would do, writing the
LWS's status and creating a group's pods from its templates (kwok runs them), and checks what
the operator makes of it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from e2e.cluster import Cluster, wait_for
from e2e.utils import Operator, _apply, _condition, _get, _isvc, _wait_condition, _wait_ready

pytestmark = pytest.mark.usefixtures("third_party_crds")

GROUP = {"replicas": 1, "gpus": 1, "nodesPerReplica": 2}


def _lws(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "leaderworkersets", "-n", namespace)["items"]


def _group_pod(lws: dict[str, Any], template: str, index: int) -> dict[str, Any]:
    """A group's pod as LWS's controller would create it from its template (owned by the LWS,
    with LWS's labels); the gang admission's gate left off (it has a test of its own)."""
    tmpl = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"][template])
    spec = tmpl["spec"]
    spec.pop("schedulingGates", None)
    name = lws["metadata"]["name"]
    labels = {
        **tmpl["metadata"]["labels"],
        "leaderworkerset.sigs.k8s.io/name": name,
        "leaderworkerset.sigs.k8s.io/group-index": "0",
        "leaderworkerset.sigs.k8s.io/worker-index": str(index),
    }
    owner = {
        "apiVersion": lws["apiVersion"],
        "kind": "LeaderWorkerSet",
        "name": name,
        "uid": lws["metadata"]["uid"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-0" if index == 0 else f"{name}-0-{index}",
            "namespace": lws["metadata"]["namespace"],
            "labels": labels,
            "annotations": tmpl["metadata"].get("annotations") or {},
            "ownerReferences": [owner],
        },
        "spec": spec,
    }


def _set_status(cluster: Cluster, lws: dict[str, Any], ready: int) -> None:
    """What LWS v0.8.0's controller writes: counts in groups, Available or Progressing
    (exclusive), and no observedGeneration anywhere (its makeCondition sets none)."""
    replicas = lws["spec"]["replicas"]
    done = ready == replicas
    at = "2026-01-01T00:00:00Z"
    conditions = [
        {"type": "Available", "status": str(done), "reason": "AllGroupsReady"},
        {"type": "Progressing", "status": str(not done), "reason": "GroupsProgressing"},
    ]
    status = {
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
            "conditions": [{**c, "message": "", "lastTransitionTime": at} for c in conditions],
        }
    }
    cluster.kubectl(
        "patch",
        "leaderworkerset",
        lws["metadata"]["name"],
        "-n",
        lws["metadata"]["namespace"],
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )


def test_a_multi_node_pool_is_a_leader_worker_set_whose_groups_status_follows(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    name = "big"
    _apply(cluster, _isvc(name, namespace, mode="Aggregated", decode=GROUP))
    wait_for("the LeaderWorkerSet", lambda: bool(_lws(cluster, namespace)), timeout=60, interval=1)
    lws = _get(cluster, "leaderworkerset", f"{name}-engine", namespace)
    isvc = _get(cluster, "tisvc", name, namespace)
    assert lws["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    spec = lws["spec"]
    assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    # the API server kept every rendered field (nothing pruned by LWS's schema)
    assert leader["args"][-6:] == [
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--leader-addr",
        "$(LWS_LEADER_ADDRESS):29500",
    ]
    assert "$(LWS_WORKER_INDEX)" in worker["args"] and "readinessProbe" not in worker
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "1"
    tp = leader["args"][leader["args"].index("--tensor-parallel-size") + 1]
    assert tp == "2"  # gpus x nodesPerReplica
    assert (
        cluster.kubectl(
            "get", "deployment", f"{name}-engine", "-n", namespace, check=False
        ).returncode
        != 0
    )

    # LWS's controller has not reported: the pool is still rolling out, nothing serves
    isvc = _wait_condition(cluster, operator, namespace, name, "DecodeReady", "RollingUpdate")
    assert _condition(isvc, "Ready")["status"] == "False"

    # the group's worker runs first: a ready worker is no serving path
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_group_pod(lws, "workerTemplate", 1)))
    _set_status(cluster, lws, ready=0)
    isvc = _wait_condition(cluster, operator, namespace, name, "DecodeReady", "PodsNotReady")
    assert _condition(isvc, "Ready")["status"] == "False"
    assert isvc["status"]["decode"]["replicas"] == "0/1"

    # the leader joins and turns Ready, LWS counts the group ready: the service serves
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_group_pod(lws, "leaderTemplate", 0)))
    _set_status(cluster, lws, ready=1)
    isvc = _wait_ready(cluster, operator, namespace, name)
    assert _condition(isvc, "DecodeReady")["status"] == "True"
    assert isvc["status"]["decode"]["replicas"] == "1/1"
    assert _condition(isvc, "RolloutComplete")["status"] == "True"

    cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        "the LeaderWorkerSet and its pods to be collected",
        lambda: (
            not _lws(cluster, namespace)
            and not cluster.kubectl_json("get", "pods", "-n", namespace)["items"]
        ),
        timeout=90,
        interval=1,
    )


def test_the_api_server_refuses_a_pool_that_would_change_kind_or_cannot_form_a_group(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """A Deployment pool cannot become a LeaderWorkerSet (the operator deletes no Deployment)
    nor the reverse; a group's size can change; a tensorParallelSize the group's GPUs cannot
    run is refused."""
    one, two, four = ({"replicas": 1, "gpus": 1, "nodesPerReplica": n} for n in (1, 2, 4))
    _apply(cluster, _isvc("small", namespace, mode="Aggregated", decode=one))
    _apply(cluster, _isvc("big", namespace, mode="Aggregated", decode=two))
    for name, to in (("small", two), ("big", one)):
        result = _apply(cluster, _isvc(name, namespace, mode="Aggregated", decode=to), False)
        assert result.returncode != 0
        assert "nodesPerReplica cannot change between 1 and more than 1" in result.stderr
    _apply(cluster, _isvc("big", namespace, mode="Aggregated", decode=four))
    wait_for(
        "the group to grow to 4 pods",
        lambda: (
            _get(cluster, "leaderworkerset", "big-engine", namespace)["spec"][
                "leaderWorkerTemplate"
            ]["size"]
            == 4
        ),
        timeout=60,
        interval=1,
    )
    _wait_ready(cluster, operator, namespace, "small")  # the Deployment pool, untouched
    assert cluster.kubectl("get", "deployment", "small-engine", "-n", namespace).returncode == 0

    bad = {**two, "tensorParallelSize": 1}
    result = _apply(cluster, _isvc("bad", namespace, mode="Aggregated", decode=bad), False)
    assert result.returncode != 0 and "times nodesPerReplica" in result.stderr
