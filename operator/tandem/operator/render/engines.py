"""The engine pools: a Deployment, a headless Service and a PodDisruptionBudget per role,
and the PodGroup that admits a Disaggregated service's engines together. Pure."""

from __future__ import annotations

import math
from typing import Any

from ..spec.inference_service import InferenceService
from ..topology import RolePlan, Topology
from .loras import lora_volume
from .meta import (
    ADMISSION_GATE,
    KV_LAYOUT_LABEL,
    MODEL_ANNOTATION,
    Manifest,
    labels,
    object_meta,
    pod_group_name,
    pool_name,
    selector_labels,
)
from .model import model_volumes
from .options import RenderOptions
from .pods import (
    GRACE_MARGIN_SECONDS,
    container_resources,
    container_security,
    env_vars,
    merge_pod_template,
    pod_security,
    scrape_annotations,
)
from .security import client_key_env, internal_credential_env

PRESTOP_SECONDS = 5  # let the proxy and EndpointSlices drop the pod before SIGTERM
STARTUP_PERIOD_SECONDS = 10
GANG_MIN_COUNT = 2
"""One prefill and one decode pod: the smallest set that serves. PodGroup's minCount is
immutable, so it cannot follow the replica counts without renaming the group (and so
rolling every pod) on each scale; pods added later to an admitted group schedule alone."""


def engine_deployment(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> Manifest:
    """Engine pods: GPUs, probes sized for slow loads, a drain on termination."""
    assert role.spec is not None
    engine = isvc.spec.engine
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(topology, role.role)},
        # Surge first so capacity never drops during a roll (it waits for a free GPU slot).
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "progressDeadlineSeconds": engine.startup_timeout_seconds + 300,
        "template": engine_pod_template(isvc, topology, role, options),
    }
    if options.hold_old_layout:
        # new pods turn Ready (and pair) but are not yet available: no old pod is retired
        spec["minReadySeconds"] = spec["progressDeadlineSeconds"] - 1
    if role.autoscaling is None:
        spec["replicas"] = role.replicas  # an autoscaled role's replicas belong to its autoscaler
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(isvc, topology, pool_name(topology, role), "engine", role.role),
        "spec": spec,
    }


def engine_pod_template(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> Manifest:
    """An engine pod's template, the role's ``podTemplate`` merged in: its labels (the
    proxy discovers it by them), the served model's annotation, and the pod spec."""
    assert role.spec is not None
    template = {
        "metadata": {
            "labels": {
                **labels(topology, "engine", role.role),
                KV_LAYOUT_LABEL: topology.kv_layout,
            },
            # the proxy's discovery reads the model name from here
            "annotations": {
                MODEL_ANNOTATION: topology.served_model_name,
                **scrape_annotations(role.port),
            },
        },
        "spec": engine_pod_spec(isvc, topology, role, options),
    }
    if role.spec.pod_template:
        template = merge_pod_template(template, role.spec.pod_template)
    return template


def engine_pod_spec(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> dict[str, Any]:
    """The engine pod: the weights and ``/dev/shm`` mounted, a grace period that covers the
    drain, and the role's own scheduling fields."""
    assert role.spec is not None
    volumes, mounts = model_volumes(isvc, topology)
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})  # NCCL between TP ranks
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if topology.lora_config:
        volume, mount = lora_volume(topology)
        volumes.append(volume)
        mounts.append(mount)
    grace = isvc.spec.engine.shutdown_timeout_seconds + PRESTOP_SECONDS + GRACE_MARGIN_SECONDS
    pod_spec: dict[str, Any] = {
        "containers": [engine_container(isvc, topology, role, options, mounts)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
        "securityContext": pod_security(),
        "enableServiceLinks": False,
    }
    rs = role.spec
    if rs.node_selector:
        pod_spec["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in rs.tolerations]
    if rs.affinity:
        pod_spec["affinity"] = dict(rs.affinity)
    if rs.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [dict(t) for t in rs.topology_spread_constraints]
    if rs.priority_class_name:
        pod_spec["priorityClassName"] = rs.priority_class_name
    if options.gang_scheduling and topology.mode == "Disaggregated":
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group_name(topology)}
    elif options.admission_gates and role.gpus > 0:
        pod_spec["schedulingGates"] = [{"name": ADMISSION_GATE}]
    return pod_spec


def engine_container(
    isvc: InferenceService,
    topology: Topology,
    role: RolePlan,
    options: RenderOptions,
    mounts: list[Manifest],
) -> dict[str, Any]:
    """``tandem serve`` with the role's argv, its GPUs, and probes that tell a slow load
    from a dead engine."""
    assert role.spec is not None
    engine = isvc.spec.engine
    return {
        "name": "engine",
        "image": engine.image or options.image,
        "imagePullPolicy": engine.image_pull_policy or options.image_pull_policy,
        "args": [*role.args, "--host", "0.0.0.0", "--port", str(role.port)],
        "ports": [{"name": "http", "containerPort": role.port, "protocol": "TCP"}],
        "env": [
            *env_vars(role.env),
            internal_credential_env(topology),
            # behind a gateway clients call the engines, with the clients' key
            *(client_key_env(isvc, "TANDEM_API_KEY") if topology.router == "gateway" else []),
        ],
        "resources": container_resources(role.spec.resources, role.gpus, "engine"),
        # Loading weights can take many minutes: the startup probe allows startupTimeoutSeconds
        # before liveness starts counting; readiness is "the model is being served".
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "failureThreshold": math.ceil(engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS),
            "timeoutSeconds": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        # /health is 503 while asleep or draining, which is not dead: liveness checks the socket.
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
            "timeoutSeconds": 5,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }


def pod_group(isvc: InferenceService, topology: Topology) -> Manifest:
    """Kubernetes' gang scheduling (scheduling.k8s.io/v1alpha2, alpha in 1.36): the scheduler
    binds none of the engine pods until a prefill and a decode pod can be bound together,
    so a half-scheduled service holds no GPU."""
    return {
        "apiVersion": "scheduling.k8s.io/v1alpha2",
        "kind": "PodGroup",
        "metadata": object_meta(isvc, topology, pod_group_name(topology), "engine"),
        "spec": {"schedulingPolicy": {"gang": {"minCount": GANG_MIN_COUNT}}},
    }


def engine_service(isvc: InferenceService, topology: Topology, role: RolePlan) -> Manifest:
    """Headless: gives each engine pod a DNS name; the proxy addresses pods, not a VIP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(isvc, topology, pool_name(topology, role), "engine", role.role),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(topology, role.role),
            "ports": [{"name": "http", "port": role.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
