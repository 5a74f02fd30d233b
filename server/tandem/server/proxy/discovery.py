"""Where the proxy learns its engines: static ``--node`` flags, or Kubernetes pods.

In a cluster the operator labels every engine pod with ``tandem.dev/role``; the proxy
watches the pods matching its selector, and a pod that is Ready, has an IP and carries
that label becomes a node at ``http://<podIP>:<port>`` (the container port named
``http``, else 8000). A pod that stops being Ready, loses its IP or is deleted is dropped
at once, without waiting for health polls to fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.server.wire.roles import parse_role

from .registry import Registry, normalize_url

log = logging.getLogger("tandem.proxy")

ROLE_LABEL = "tandem.dev/role"
MODEL_ANNOTATION = "tandem.dev/served-model-name"
KV_LAYOUT_LABEL = "tandem.dev/kv-layout"
DEFAULT_ENGINE_PORT = 8000


def parse_node_flag(value: str) -> tuple[str, str]:
    """``--node URL[=role]`` -> (normalized url, role); the role defaults to ``both``."""
    url, sep, role = value.rpartition("=")
    if not sep:
        url, role = value, "both"
    return normalize_url(url), parse_role(role)


def pod_node(
    pod: dict[str, Any], port: int | None = None, default_role: str | None = None
) -> tuple[str, str, list[str] | None] | None:
    """(url, role, models) for a pod that should be a node, or None.

    ``pod`` is the pod's JSON (camelCase keys, as the API server sends it); ``port``: the
    engine's port when the caller knows it (an InferencePool's target port), else the
    container port named ``http`` or 8000; ``default_role``: the role of a pod without the
    role label (a pool's pods are engines whatever their labels), else such a pod is none.
    """
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    role = (meta.get("labels") or {}).get(ROLE_LABEL) or default_role
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not role or not ip or status.get("phase") not in (None, "Running"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    if not ready:
        return None
    try:
        role_name = parse_role(role)
    except ValueError:
        log.warning(
            "pod %s has an invalid %s label %r; ignored", meta.get("name"), ROLE_LABEL, role
        )
        return None
    if port is None:
        port = DEFAULT_ENGINE_PORT
        for container in (pod.get("spec") or {}).get("containers") or []:
            for p in container.get("ports") or []:
                if p.get("name") == "http" and p.get("containerPort"):
                    port = int(p["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip
    model = (meta.get("annotations") or {}).get(MODEL_ANNOTATION)
    return f"http://{host}:{port}", role_name, [model] if model else None


class PodTracker:
    """Applies pod watch events to the registry; remembers which node each pod became.

    A URL is a pod IP, and IPs are reused: a pod created after another was deleted can get
    its IP, and so its URL, before the tracker has heard that the old pod is gone (a relist
    after a watch gap, or a force-deleted pod's DELETED event arriving after the new pod's).
    So a node is removed only when no tracked pod still maps to its URL.
    """

    def __init__(
        self, registry: Registry, port: int | None = None, default_role: str | None = None
    ) -> None:
        self.registry = registry
        self.port = port  # ``pod_node``'s: an InferencePool's target port (it may change)
        self.default_role = default_role
        self._by_pod: dict[str, str] = {}  # pod uid (or namespace/name) -> node url

    def apply(self, event_type: str, pod: dict[str, Any]) -> None:
        node = None if event_type == "DELETED" else pod_node(pod, self.port, self.default_role)
        key = _pod_key(pod)
        old = self._by_pod.get(key)
        if old is not None and (node is None or node[0] != old):
            self._forget(key)
        if node is not None:
            url, role, models = node
            self._by_pod[key] = url
            layout = ((pod.get("metadata") or {}).get("labels") or {}).get(KV_LAYOUT_LABEL)
            self.registry.add(url, role, models, source="kubernetes", kv_layout=layout)

    def resync(self, pods: list[dict[str, Any]]) -> None:
        """A full listing: add what is there, drop what is gone."""
        seen = set()
        for pod in pods:
            seen.add(_pod_key(pod))
            self.apply("MODIFIED", pod)
        for key in [k for k in self._by_pod if k not in seen]:
            self._forget(key)

    def _forget(self, key: str) -> None:
        url = self._by_pod.pop(key)
        if url not in self._by_pod.values():  # another pod has this IP now: its node stays
            self.registry.remove(url)


def _pod_key(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"


def kubernetes_discovery(
    namespace: str, selector: str, api_factory: Callable[[], Any] | None = None
) -> Callable[[Registry], contextlib.AbstractAsyncContextManager[None]]:
    """A discovery for ``ProxySettings.discovery``: watches pods in ``namespace`` matching
    ``selector`` on a thread (the kubernetes client is synchronous) and applies the events on
    the proxy's event loop."""

    @contextlib.asynccontextmanager
    async def run(registry: Registry) -> AsyncIterator[None]:
        from kubernetes import client, config, watch

        if api_factory is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.CoreV1Api()
        else:
            api = api_factory()
        serialize = client.ApiClient().sanitize_for_serialization
        loop = asyncio.get_running_loop()
        tracker = PodTracker(registry)
        stop = threading.Event()
        w = watch.Watch()

        def worker() -> None:
            while not stop.is_set():
                try:
                    listing = api.list_namespaced_pod(namespace, label_selector=selector)
                    pods = [serialize(p) for p in listing.items]
                    loop.call_soon_threadsafe(tracker.resync, pods)
                    for event in w.stream(
                        api.list_namespaced_pod,
                        namespace,
                        label_selector=selector,
                        resource_version=listing.metadata.resource_version,
                        timeout_seconds=60,
                    ):
                        if stop.is_set():
                            break
                        loop.call_soon_threadsafe(
                            tracker.apply, event["type"], serialize(event["object"])
                        )
                except Exception as exc:  # noqa: BLE001 - keep watching through API hiccups
                    if stop.is_set():
                        break
                    log.warning("pod watch failed (%s); retrying", exc)
                    stop.wait(2.0)

        thread = threading.Thread(target=worker, name="tandem-pod-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            w.stop()

    return run
