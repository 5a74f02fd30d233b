"""An engine pool whose replicas span nodes (``nodesPerReplica`` > 1): a LeaderWorkerSet.
Pure.

Each replica is one LWS group of ``nodesPerReplica`` pods, each with the role's ``gpus``, that
together run one engine of ``gpus x nodesPerReplica`` tensor-parallel ranks (KServe, llm-d,
Dynamo and AIBrix use LWS the same way). The leader (LWS worker index 0) is an engine pod as
a Deployment's would be: the proxy discovers it, its probes say when the engine serves, and
it listens for the group's rendezvous. The workers run ``tandem serve --node-rank N``: they
join the leader's process group at ``$(LWS_LEADER_ADDRESS)`` (LWS's controller injects it and
``LWS_WORKER_INDEX``; the kubelet expands them in the args) and serve nothing, so they carry
the ``engine-worker`` component (no discovery, no probes, no scrape annotations).

``startupPolicy: LeaderCreated`` creates the workers with the leader, so all of a group's
pods load at once; ``RecreateGroupOnPodRestart`` restarts the whole group when one pod does,
as a torch.distributed group cannot take back a restarted rank.
"""

from __future__ import annotations

import copy
from typing import Any

from ..spec.inference_service import InferenceService
from ..topology import COMPONENT_LABEL, ENGINE_SELECTOR_LABEL, RolePlan, Topology
from .engines import engine_pod_template
from .meta import (
    GROUP_WORKER_COMPONENT,
    MODEL_ANNOTATION,
    Manifest,
    child_base,
    object_meta,
    pool_name,
)
from .options import RenderOptions

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
RENDEZVOUS_PORT = 29500
"""Where the leader's rank 0 listens for the group's other ranks (torch.distributed's TCP
store; the collectives then open ports of their own between the group's pods)."""
LEADER_ADDRESS = f"$(LWS_LEADER_ADDRESS):{RENDEZVOUS_PORT}"


def engine_leader_worker_set(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> Manifest:
    """The pool as a LeaderWorkerSet: ``replicas`` groups of ``size`` pods, one engine each."""
    template = engine_pod_template(isvc, topology, role, options)
    spec: dict[str, Any] = {
        "startupPolicy": "LeaderCreated",
        # Surge first, as the engine Deployments do: a new group loads before an old one goes.
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "leaderWorkerTemplate": {
            "size": role.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": group_member(template, role, leader=True),
            "workerTemplate": group_member(template, role, leader=False),
        },
    }
    if role.autoscaling is None:
        spec["replicas"] = role.replicas
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": object_meta(isvc, topology, pool_name(topology, role), "engine", role.role),
        "spec": spec,
    }


def group_member(template: Manifest, role: RolePlan, leader: bool) -> Manifest:
    """An engine pod template made a group's leader or worker: the group's flags added to
    ``tandem serve``; a worker loses what only a serving engine has."""
    out = copy.deepcopy(template)
    engine = next(c for c in out["spec"]["containers"] if c["name"] == "engine")
    node_rank = "0" if leader else "$(LWS_WORKER_INDEX)"
    engine["args"] = [
        *engine["args"],
        *("--nnodes", str(role.nodes), "--node-rank", node_rank),
        *("--leader-addr", LEADER_ADDRESS),
    ]
    if leader:
        engine["ports"] = [
            *engine["ports"],
            {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        ]
        return out
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        engine.pop(key, None)
    meta = out["metadata"]
    meta["labels"][COMPONENT_LABEL] = GROUP_WORKER_COMPONENT
    annotations = {
        k: v
        for k, v in meta.pop("annotations", {}).items()
        if k != MODEL_ANNOTATION and not k.startswith("prometheus.io/")
    }
    if annotations:
        meta["annotations"] = annotations
    return out


def group_worker_network_policy(isvc: InferenceService, topology: Topology) -> Manifest:
    """The workers take traffic only from this InferenceService's own pods (their leader and
    the group's other ranks, on the collectives' ports), as the engines' policy does for the
    engines; they serve nothing, so nothing else needs them."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(
            isvc, topology, f"{child_base(topology.name)}-engine-workers", GROUP_WORKER_COMPONENT
        ),
        "spec": {
            "podSelector": {
                "matchLabels": {
                    ENGINE_SELECTOR_LABEL: topology.name,
                    COMPONENT_LABEL: GROUP_WORKER_COMPONENT,
                }
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {ENGINE_SELECTOR_LABEL: topology.name}}}]}
            ],
        },
    }
