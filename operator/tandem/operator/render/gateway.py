"""``router: gateway``: the Gateway API Inference Extension objects (``docs/gateway.md``).
Pure.

An ``InferencePool`` selecting the engine pods, whose endpoint picker is ``tandem epp``
(its Deployment, Service and the proxy's discovery RBAC plus reading the pool: it takes
the pool's selector and port from the pool and watches its pods as the proxy does), and, when ``spec.gateway.httpRoute`` asks, an ``HTTPRoute`` from those Gateways to
the pool. A GIE gateway then routes clients to the engines directly.
"""

from __future__ import annotations

from typing import Any

from ..spec.inference_service import InferenceService
from ..topology import COMPONENT_LABEL, ENGINE_PORT, ENGINE_SELECTOR_LABEL, RolePlan, Topology
from .meta import Manifest, object_meta, pool_name, selector_labels
from .options import RenderOptions
from .pods import (
    container_resources,
    container_security,
    env_vars,
    pod_disruption_budget,
)
from .proxy import front_door_deployment, proxy_rbac
from .security import internal_credential_env

POOL_API_VERSION = "inference.networking.k8s.io/v1"
ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"


def gateway_objects(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> list[Manifest]:
    """The picker's RBAC, Deployment, Service and disruption budget, the InferencePool, and
    the HTTPRoute when asked."""
    name = pool_name(topology, role)
    account, rbac_role, binding = proxy_rbac(isvc, topology, name)
    # the picker reads its InferencePool (``--pool-name``): that one object, read only
    rbac_role["rules"].append(
        {
            "apiGroups": [POOL_API_VERSION.partition("/")[0]],
            "resources": ["inferencepools"],
            "resourceNames": [topology.name],
            "verbs": ["get"],
        }
    )
    out = [
        account,
        rbac_role,
        binding,
        picker_deployment(isvc, topology, role, options),
        picker_service(isvc, topology, role),
        pod_disruption_budget(isvc, topology, role),
        inference_pool(isvc, topology, role),
    ]
    if isvc.spec.gateway.http_route is not None:
        out.append(http_route(isvc, topology))
    return out


def inference_pool(isvc: InferenceService, topology: Topology, role: RolePlan) -> Manifest:
    """The pool a GIE gateway routes to: every engine pod (the picker chooses among them)."""
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": object_meta(isvc, topology, topology.name, "proxy"),
        "spec": {
            "selector": {
                "matchLabels": {ENGINE_SELECTOR_LABEL: topology.name, COMPONENT_LABEL: "engine"}
            },
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "group": "",  # the core API group: a Service (the schema's default)
                "kind": "Service",
                "name": pool_name(topology, role),
                "port": {"number": role.port},
                "failureMode": isvc.spec.gateway.failure_mode,
            },
        },
    }


def http_route(isvc: InferenceService, topology: Topology) -> Manifest:
    """Every path from the given Gateways to the pool."""
    route = isvc.spec.gateway.http_route
    assert route is not None
    parents = [
        {
            "name": p.name,
            **({"namespace": p.namespace} if p.namespace else {}),
            **({"sectionName": p.section_name} if p.section_name else {}),
        }
        for p in route.parent_refs
    ]
    spec: dict[str, Any] = {
        "parentRefs": parents,
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [
                    {
                        "group": POOL_API_VERSION.split("/")[0],
                        "kind": "InferencePool",
                        "name": topology.name,
                    }
                ],
            }
        ],
    }
    if route.hostnames:
        spec["hostnames"] = list(route.hostnames)
    return {
        "apiVersion": ROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": object_meta(isvc, topology, topology.name, "proxy"),
        "spec": spec,
    }


def picker_container(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> dict[str, Any]:
    """``tandem epp``; the internal credential (it signs the prefill engine it names to a
    decode engine, and answers the engines' node challenge) from the environment."""
    grpc_probe = {"port": role.port}
    return {
        "name": "epp",
        "image": isvc.spec.engine.image or options.image,
        "imagePullPolicy": isvc.spec.engine.image_pull_policy or options.image_pull_policy,
        "args": [*role.args, "--host", "0.0.0.0", "--port", str(role.port)],
        "ports": [{"name": "grpc", "containerPort": role.port, "protocol": "TCP"}],
        "env": [*env_vars(role.env), internal_credential_env(topology)],
        "resources": container_resources(isvc.spec.proxy.resources, 0, "proxy"),
        "readinessProbe": {"grpc": {**grpc_probe, "service": "readiness"}, "periodSeconds": 5},
        "livenessProbe": {
            "grpc": {**grpc_probe, "service": "liveness"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": container_security(),
    }


def picker_deployment(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> Manifest:
    return front_door_deployment(
        isvc, topology, role, picker_container(isvc, topology, role, options)
    )


def picker_service(isvc: InferenceService, topology: Topology, role: RolePlan) -> Manifest:
    """The picker's gRPC endpoint, which the InferencePool's ``endpointPickerRef`` names."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(isvc, topology, pool_name(topology, role), "proxy", role.role),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(topology, role.role),
            "ports": [
                {
                    "name": "grpc",
                    "port": role.port,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                }
            ],
        },
    }
