"""The proxy: its Deployment, the Service that is the OpenAI endpoint, and the RBAC its
engine discovery needs. Pure."""

from __future__ import annotations

from typing import Any

from ..spec.inference_service import InferenceService
from ..topology import RolePlan, Topology
from .meta import Manifest, labels, object_meta, pool_name, proxy_service_name, selector_labels
from .options import RenderOptions
from .pods import (
    GRACE_MARGIN_SECONDS,
    container_resources,
    container_security,
    env_vars,
    pod_disruption_budget,
    pod_security,
    scrape_annotations,
)
from .security import client_key_env, internal_credential_env


def proxy_objects(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> list[Manifest]:
    """The proxy Deployment, its Service (the OpenAI endpoint) and the RBAC its discovery needs."""
    return [
        *proxy_rbac(isvc, topology, pool_name(topology, role)),
        proxy_deployment(isvc, topology, role, options),
        proxy_service(isvc, topology),
        pod_disruption_budget(isvc, topology, role),
    ]


def proxy_container(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> dict[str, Any]:
    """``tandem proxy``; its keys reach it through the environment, never its argv."""
    proxy = isvc.spec.proxy
    args = [*role.args, "--host", "0.0.0.0", "--port", str(role.port)]
    # keys are read from the environment: never an argument, which ps would show
    env: list[dict[str, Any]] = [
        *env_vars(role.env),
        internal_credential_env(topology),
        *client_key_env(isvc, "TANDEM_PROXY_API_KEY"),
    ]
    container: dict[str, Any] = {
        "name": "proxy",
        "image": isvc.spec.engine.image or options.image,
        "imagePullPolicy": isvc.spec.engine.image_pull_policy or options.image_pull_policy,
        "args": args,
        "ports": [{"name": "http", "containerPort": role.port, "protocol": "TCP"}],
        "resources": container_resources(proxy.resources, 0, "proxy"),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": container_security(),
    }
    container["env"] = env
    return container


def proxy_deployment(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> Manifest:
    container = proxy_container(isvc, topology, role, options)
    return front_door_deployment(isvc, topology, role, container, scrape_annotations(role.port))


def front_door_deployment(
    isvc: InferenceService,
    topology: Topology,
    role: RolePlan,
    container: dict[str, Any],
    annotations: dict[str, str] | None = None,
) -> Manifest:
    """A front door's Deployment (the proxy's, or behind a gateway the picker's), running
    under its own ServiceAccount (its discovery's RBAC)."""
    name = pool_name(topology, role)
    template_meta: dict[str, Any] = {"labels": labels(topology, "proxy", role.role)}
    if annotations:
        template_meta["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(isvc, topology, name, "proxy", role.role),
        "spec": {
            "replicas": role.replicas,
            "selector": {"matchLabels": selector_labels(topology, role.role)},
            "template": {
                "metadata": template_meta,
                "spec": {
                    "serviceAccountName": name,
                    "containers": [container],
                    "securityContext": pod_security(),
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": isvc.spec.engine.shutdown_timeout_seconds
                    + GRACE_MARGIN_SECONDS,
                },
            },
        },
    }


def proxy_service(isvc: InferenceService, topology: Topology) -> Manifest:
    """The OpenAI endpoint, ``NAME.NAMESPACE.svc``, of the type and port that
    ``spec.proxy.service`` asks for."""
    service = isvc.spec.proxy.service
    meta = object_meta(isvc, topology, proxy_service_name(topology), "proxy", "proxy")
    if service.annotations:
        meta["annotations"] = dict(service.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": service.type,
            "selector": selector_labels(topology, "proxy"),
            "ports": [
                {
                    "name": "http",
                    "port": service.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def proxy_rbac(isvc: InferenceService, topology: Topology, name: str) -> list[Manifest]:
    """The proxy's ServiceAccount, and a Role to watch pods and EndpointSlices (its
    discovery of the engines) bound to it."""
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(isvc, topology, name, "proxy", "proxy"),
    }
    rbac_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_meta(isvc, topology, name, "proxy", "proxy"),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(isvc, topology, name, "proxy", "proxy"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": topology.namespace}],
    }
    return [account, rbac_role, binding]
