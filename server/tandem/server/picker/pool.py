"""Where the picker finds its engines in a cluster the way GIE's own picker does
(``--pool-name``, ``--pool-namespace``): from the ``InferencePool`` object itself. The pool's
selector picks the model-server pods and its target port is where they listen, so whoever
edits the pool (the operator, a platform team) moves the picker with it; nothing is copied
into the picker's flags. The pods are then tracked as the proxy tracks them
(``proxy.discovery.PodTracker``): a Ready pod with an IP is an engine, gone at once when it
stops being one.

The pool is read again at every relist of its pods (``REREAD_SECONDS``), so a change of its
selector or port takes effect within that; a pool that does not exist (yet, or any more)
routes to nothing (503s) until it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tandem.server.proxy.discovery import PodTracker
from tandem.server.proxy.registry import Registry

log = logging.getLogger("tandem.picker")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
REREAD_SECONDS = 15


@dataclass(frozen=True)
class PoolTarget:
    """What an InferencePool says of its pods: which (a label selector) and their port."""

    selector: str
    port: int


def pool_target(pool: dict[str, Any]) -> PoolTarget:
    """The pool's selector and target port. ``inference.networking.k8s.io/v1``:
    ``spec.selector.matchLabels`` and ``spec.targetPorts[].number``; the older
    ``v1alpha2`` shape (a plain label map, ``targetPortNumber``) reads the same. A pool
    with several target ports (several engines per pod) is routed to its first."""
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else None
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError(f"InferencePool has no label selector: {selector!r}")
    ports = spec.get("targetPorts") or []
    if not ports and "targetPortNumber" in spec:
        ports = [{"number": spec["targetPortNumber"]}]
    if not ports or not isinstance(ports[0], dict) or not ports[0].get("number"):
        raise ValueError(f"InferencePool has no target port: {spec!r}")
    if len(ports) > 1:
        log.warning("InferencePool has %d target ports; routing to the first", len(ports))
    match = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return PoolTarget(match, int(ports[0]["number"]))


@dataclass(frozen=True)
class PoolApi:
    """What watching a pool needs of the API server (the kubernetes client's calls)."""

    get_pool: Callable[[], dict[str, Any] | None]  # None: no such pool
    list_pods: Callable[[str], tuple[list[dict[str, Any]], str]]  # selector -> pods, version
    watch_pods: Callable[[str, str, int], Iterable[tuple[str, dict[str, Any]]]]


def _retarget(tracker: PodTracker, target: PoolTarget | None, pods: list[dict[str, Any]]) -> None:
    if target is not None:
        tracker.port = target.port
    tracker.resync(pods)


def watch_pool(
    api: PoolApi,
    call: Callable[[Callable[[], None]], object],
    tracker: PodTracker,
    stop: threading.Event,
) -> None:
    """Until ``stop``: read the pool, list its pods, follow them for ``REREAD_SECONDS``,
    again. ``call`` runs each change where the registry lives (the event loop)."""
    while not stop.is_set():
        try:
            pool = api.get_pool()
            if pool is None:
                log.warning("InferencePool not found; no engines until it exists")
                call(functools.partial(_retarget, tracker, None, []))
                stop.wait(REREAD_SECONDS)
                continue
            target = pool_target(pool)
            pods, version = api.list_pods(target.selector)
            call(functools.partial(_retarget, tracker, target, pods))
            for kind, pod in api.watch_pods(target.selector, version, REREAD_SECONDS):
                if stop.is_set():
                    return
                call(functools.partial(tracker.apply, kind, pod))
        except Exception as exc:  # noqa: BLE001 - keep watching through API hiccups
            if stop.is_set():
                return
            log.warning("InferencePool watch failed (%s); retrying", exc)
            stop.wait(2.0)


def kubernetes_pool_api(namespace: str, name: str) -> PoolApi:
    """``PoolApi`` over the kubernetes client (in-cluster config, else kubeconfig)."""
    from kubernetes import client, config, watch

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()
    serialize = client.ApiClient().sanitize_for_serialization

    def get_pool() -> dict[str, Any] | None:
        try:
            return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_pods(selector: str) -> tuple[list[dict[str, Any]], str]:
        listing = core.list_namespaced_pod(namespace, label_selector=selector)
        return [serialize(p) for p in listing.items], listing.metadata.resource_version

    def watch_pods(
        selector: str, version: str, seconds: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        events = watch.Watch().stream(
            core.list_namespaced_pod,
            namespace,
            label_selector=selector,
            resource_version=version,
            timeout_seconds=seconds,
        )
        for event in events:
            yield event["type"], serialize(event["object"])

    return PoolApi(get_pool, list_pods, watch_pods)


def pool_discovery(
    namespace: str, name: str, api_factory: Callable[[], PoolApi] | None = None
) -> Callable[[Registry], contextlib.AbstractAsyncContextManager[None]]:
    """A discovery for ``PickerSettings.discovery``: the pool's pods, watched on a thread
    (the kubernetes client is synchronous), applied on the picker's event loop. A pod of
    the pool without Tandem's role label is an engine serving both phases."""

    @contextlib.asynccontextmanager
    async def run(registry: Registry) -> AsyncIterator[None]:
        api = api_factory() if api_factory else kubernetes_pool_api(namespace, name)
        loop = asyncio.get_running_loop()
        tracker = PodTracker(registry, default_role="both")
        stop = threading.Event()
        thread = threading.Thread(
            target=watch_pool,
            args=(api, loop.call_soon_threadsafe, tracker, stop),
            name="tandem-pool-watch",
            daemon=True,
        )
        thread.start()
        try:
            yield
        finally:
            stop.set()

    return run
