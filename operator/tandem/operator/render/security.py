"""The trust boundary as objects: the internal credential the proxy and the engines share,
and the NetworkPolicy that keeps other pods off the engines (``docs/security.md``). Pure."""

from __future__ import annotations

from typing import Any

from ..spec.inference_service import InferenceService
from ..topology import COMPONENT_LABEL, ENGINE_SELECTOR_LABEL, Topology
from .meta import Manifest, child_base, internal_secret_name, object_meta

INTERNAL_KEY = "internal-api-key"  # the key in the internal-credential Secret
METRICS_SCRAPER_LABEL = "tandem.dev/metrics-scraper"


def internal_credential_secret(isvc: InferenceService, topology: Topology, token: str) -> Manifest:
    """The credential the proxy and the engines share (``docs/security.md``). Rendered from a
    token the operator generates once: it is created when absent and never re-applied, so
    running pods and new ones always agree."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(isvc, topology, internal_secret_name(topology), "credentials"),
        "type": "Opaque",
        "stringData": {INTERNAL_KEY: token},
    }


def internal_credential_env(topology: Topology) -> dict[str, Any]:
    """The internal credential as an environment variable from its Secret (never an argument)."""
    return {
        "name": "TANDEM_INTERNAL_API_KEY",
        "valueFrom": {
            "secretKeyRef": {"name": internal_secret_name(topology), "key": INTERNAL_KEY}
        },
    }


def client_key_env(isvc: InferenceService, name: str) -> list[dict[str, Any]]:
    """The clients' key (``spec.proxy.apiKeySecret``) as the variable ``name`` from its
    Secret, for whichever program takes clients: the proxy, or behind a gateway the engines."""
    ref = isvc.spec.proxy.api_key_secret
    if ref is None:
        return []
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def network_policy(isvc: InferenceService, topology: Topology) -> Manifest:
    """Engine pods accept traffic (HTTP and the KV transport) only from this InferenceService's
    own pods (its proxy and peer engines), plus pods labelled ``tandem.dev/metrics-scraper``
    (any namespace) on the HTTP port for /metrics. Kubelet probes are not subject to it.
    Behind a gateway (``router: gateway``) clients reach the engines through it, so the HTTP
    port is open to any pod (each request needs a client key); the KV transport is not."""
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(isvc, topology, f"{child_base(topology.name)}-engines", "engine"),
        "spec": {
            "podSelector": {
                "matchLabels": {ENGINE_SELECTOR_LABEL: topology.name, COMPONENT_LABEL: "engine"}
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": {ENGINE_SELECTOR_LABEL: topology.name}}}
                    ]
                },
                {
                    "from": [
                        {
                            "namespaceSelector": {},
                            "podSelector": {"matchLabels": {METRICS_SCRAPER_LABEL: "true"}},
                        }
                    ],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                },
            ],
        },
    }
    if topology.router == "gateway":
        policy["spec"]["ingress"].append({"ports": [{"port": "http", "protocol": "TCP"}]})
    return policy
