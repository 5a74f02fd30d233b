"""A thin Kubernetes REST client: server-side apply, status patches, lists, deletes.

The official client's typed models cost time and memory for nothing here: the operator
already has plain manifests (``tandem.operator.render``) and applies them as they are. This
wraps the official client's configured connection (auth, TLS, proxies) and speaks JSON.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from kubernetes import client, config

FIELD_MANAGER = "tandem-operator"

# apiVersion/kind -> plural; only the kinds the render package produces (and the InferenceService).
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "Job": "jobs",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "ConfigMap": "configmaps",
    "Pod": "pods",
    "PodGroup": "podgroups",
    "LeaderWorkerSet": "leaderworkersets",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "InferencePool": "inferencepools",
    "HTTPRoute": "httproutes",
    "InferenceService": "inferenceservices",
}


class KubeError(RuntimeError):
    def __init__(self, status: int, body: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body
        self.message = f"{what}: {api_message(body) or f'HTTP {status}'}"
        """What the API server said (its Status message), for a condition a user reads."""


def api_message(body: str) -> str | None:
    """The ``message`` of a Kubernetes ``Status`` response body, if it is one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get("message") if isinstance(data, dict) else None


def load_config(kubeconfig: str | None = None) -> client.ApiClient:
    """In a pod: the ServiceAccount; otherwise the kubeconfig (``--kubeconfig`` or $KUBECONFIG)."""
    try:
        if kubeconfig:
            raise config.ConfigException("a kubeconfig was given")
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{PLURALS[kind]}"


def object_path(manifest: dict[str, Any]) -> str:
    meta = manifest["metadata"]
    return f"{collection_path(manifest['apiVersion'], manifest['kind'], meta.get('namespace'))}/{quote(meta['name'])}"


class Kube:
    """Synchronous calls; the async handlers run them in threads."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        ok_missing: bool = False,
    ) -> dict[str, Any] | None:
        params = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*params, _request_timeout=30)
        response.read()
        data = response.data.decode() if isinstance(response.data, bytes) else (response.data or "")
        if response.status == 404 and ok_missing:
            return None
        if response.status >= 400:
            raise KubeError(response.status, data, f"{method} {path}")
        return json.loads(data) if data else None

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Server-side apply as the operator's field manager; ``force`` takes fields back
        from a human's ``kubectl edit`` (the spec is the source of truth). A failure names
        the object (``apply Deployment/x``) beside the API server's message."""
        try:
            return self.request(
                "PATCH",
                object_path(manifest),
                manifest,
                query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                content_type="application/apply-patch+yaml",
            )
        except KubeError as exc:
            what = f"apply {manifest['kind']}/{manifest['metadata']['name']}"
            raise KubeError(exc.status, exc.body, what) from None

    def create_if_absent(self, manifest: dict[str, Any]) -> bool:
        """Create once, never update (a generated credential must not change under running
        pods); True when this call created it."""
        meta = manifest["metadata"]
        try:
            self.request(
                "POST",
                collection_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace")),
                manifest,
                query=[("fieldManager", FIELD_MANAGER)],
            )
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        path = (
            collection_path("tandem.dev/v1alpha1", "InferenceService", namespace)
            + f"/{quote(name)}/status"
        )
        self.request(
            "PATCH",
            path,
            {"status": status},
            content_type="application/merge-patch+json",
            ok_missing=True,
        )

    def remove_gate(self, namespace: str, pod: str, gate: str) -> None:
        """Remove one schedulingGate from a pod (the only change a pod's gates allow), with a
        JSON patch that tests the gate is still there, so a concurrent edit is not undone."""
        path = f"/api/v1/namespaces/{namespace}/pods/{quote(pod)}"
        current = self.request("GET", path, ok_missing=True)
        gates = ((current or {}).get("spec") or {}).get("schedulingGates") or []
        names = [g.get("name") for g in gates]
        if gate not in names:
            return
        index = names.index(gate)
        patch = [
            {"op": "test", "path": f"/spec/schedulingGates/{index}/name", "value": gate},
            {"op": "remove", "path": f"/spec/schedulingGates/{index}"},
        ]
        self.request("PATCH", path, patch, content_type="application/json-patch+json")

    def post_event(
        self, involved: dict[str, Any], type_: str, reason: str, message: str, now: str
    ) -> None:
        """A core/v1 Event on ``involved`` (what `kubectl describe` and `get events` show).
        Posted synchronously, so an operator that stops right after loses none."""
        meta = involved["metadata"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", event)

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str, ok_missing: bool = False
    ) -> list[dict[str, Any]]:
        """``ok_missing``: an API the cluster does not serve (a CRD not installed) lists empty."""
        data = self.request(
            "GET",
            collection_path(api_version, kind, namespace),
            query=[("labelSelector", selector)],
            ok_missing=ok_missing,
        )
        return list((data or {}).get("items") or [])

    def delete(self, manifest: dict[str, Any]) -> None:
        self.request(
            "DELETE", object_path(manifest), {"propagationPolicy": "Background"}, ok_missing=True
        )
