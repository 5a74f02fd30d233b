"""Every child's identity: its name, its labels, and its owner reference. Pure.

The names and labels are what the rest of the operator finds children by (the status's
indexes, the proxy's discovery, pruning), so they are decided here once.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..spec.inference_service import API_VERSION, KIND, NAME_MAX, InferenceService
from ..topology import COMPONENT_LABEL, ENGINE_SELECTOR_LABEL, RolePlan, Topology

ROLE_LABEL = "tandem.dev/role"
MODEL_ANNOTATION = "tandem.dev/served-model-name"
KV_LAYOUT_LABEL = "tandem.dev/kv-layout"
MODEL_CACHED_ANNOTATION = "tandem.dev/cached-model"
MANAGER = "tandem-operator"
GROUP_WORKER_COMPONENT = "engine-worker"
"""The component label of a multi-node group's non-leader pods: they run tensor-parallel
ranks and serve nothing (``leader_worker_set.py``), so the proxy never discovers them."""
ADMISSION_GATE = "tandem.dev/gang-admission"
"""The schedulingGate engine pods are created with; the operator's gang admission removes it."""

Manifest = dict[str, Any]

DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_DIGEST_CHARS = 6


def child_base(name: str) -> str:
    """The prefix of every child's name: ``name`` itself when it is a DNS-1035 label (a
    Service's name must be one), else a cleaned, prefixed form plus a stable hash of the
    original. The API server accepts any DNS-1123 subdomain up to NAME_MAX characters
    (``1model``, ``a.b``); each then gets children it can name, and two names never share
    children (``a.b`` and ``a-b`` differ by the hash). At most NAME_MAX characters."""
    if DNS_1035_LABEL.match(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:NAME_DIGEST_CHARS]
    cleaned = re.sub(r"[^a-z0-9-]", "-", name)
    if not cleaned[0].isalpha():
        cleaned = f"x{cleaned}"
    cleaned = cleaned[: NAME_MAX - NAME_DIGEST_CHARS - 1].rstrip("-")
    return f"{cleaned}-{digest}"


def labels(topology: Topology, component: str, role: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": topology.name,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/part-of": "tandem",
        "app.kubernetes.io/managed-by": MANAGER,
        ENGINE_SELECTOR_LABEL: topology.name,
    }
    if role:
        out[ROLE_LABEL] = role
    return out


def selector_labels(topology: Topology, role: str) -> dict[str, str]:
    """Immutable in a Deployment, so only labels that never change for a pool."""
    return {ENGINE_SELECTOR_LABEL: topology.name, ROLE_LABEL: role}


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": isvc.metadata.name,
        "uid": isvc.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    isvc: InferenceService, topology: Topology, name: str, component: str, role: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": topology.namespace,
        "labels": labels(topology, component, role),
    }
    if isvc.metadata.uid:
        meta["ownerReferences"] = [owner_reference(isvc)]
    return meta


def pool_name(topology: Topology, role: RolePlan) -> str:
    return f"{child_base(topology.name)}-{role.name}"


def proxy_service_name(topology: Topology) -> str:
    return child_base(topology.name)


def download_job_name(topology: Topology) -> str:
    digest = hashlib.sha256(
        f"{topology.model.repo_id}@{topology.model.revision}".encode()
    ).hexdigest()[:8]
    return f"{child_base(topology.name)}-download-{digest}"


def cache_claim_name(isvc: InferenceService) -> str:
    cache = isvc.spec.model.cache
    return (
        cache.claim_name
        if cache and cache.claim_name
        else f"{child_base(isvc.metadata.name)}-model-cache"
    )


def cached_model_key(topology: Topology) -> str:
    """What the cache claim's annotation says once the model is downloaded into it."""
    return f"{topology.model.repo_id}@{topology.model.revision}"


def service_url(isvc: InferenceService) -> str:
    """The in-cluster OpenAI endpoint."""
    port, host = isvc.spec.proxy.service.port, child_base(isvc.metadata.name)
    return f"http://{host}.{isvc.metadata.namespace}.svc.cluster.local:{port}/v1"


def internal_secret_name(topology: Topology) -> str:
    return f"{child_base(topology.name)}-internal"


def lora_config_map_name(topology: Topology) -> str:
    return f"{child_base(topology.name)}-loras"


def pod_group_name(topology: Topology) -> str:
    return f"{child_base(topology.name)}-engines"
