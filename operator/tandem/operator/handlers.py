"""kopf handlers: apply the rendered children, recompute status from them. The I/O edge.

Level-based: every reconcile renders the whole desired state from the spec and
server-side applies it (a no-op when nothing changed), so a restart, a missed event or a
hand-deleted child all converge the same way. Status comes from in-memory indexes of the
children (Deployments, Pods, Jobs) that kopf keeps from its watches, recomputed on each
child event and on a timer, and written only when it changes.

kopf's own bookkeeping (handler progress, the last handled spec) lives in annotations under
``kopf.tandem.dev/``, never in ``status``, which belongs to the users' view. No delete
handler and so no finalizer: every child has a controller owner reference and the
garbage collector removes it with the InferenceService.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from .kube import Kube, KubeError
from .plan import ENGINE_SELECTOR_LABEL, Topology, plan
from .render import (
    MANAGER,
    ROLE_LABEL,
    RenderOptions,
    download_job_name,
    internal_credential_secret,
    render,
)
from .spec import GROUP, PLURAL, VERSION, InferenceService, load_inference_service
from .status import (
    Children,
    compute_status,
    status_changed,
    summarize_deployment,
    summarize_job,
    summarize_pod,
)

MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
KOPF_PREFIX = "kopf.tandem.dev"
# Kinds that a spec change can make obsolete; the rest always exist for every spec.
PRUNABLE = (("autoscaling/v2", "HorizontalPodAutoscaler"), ("batch/v1", "Job"))

log = logging.getLogger("tandem.operator")


@dataclass(frozen=True)
class OperatorOptions:
    render: RenderOptions = RenderOptions()
    resync_seconds: float = 60.0
    peering: str | None = None
    """kopf peering object for leader election among replicas; None runs standalone."""
    namespaces: tuple[str, ...] = ()
    """Watched namespaces; empty is cluster-wide (and a ClusterKopfPeering)."""


@dataclass
class _State:
    """Per-registry state (not module-level): the client and per-object bookkeeping."""

    options: OperatorOptions
    kube: Kube | None = None
    applied_generation: dict[tuple[str, str], int] = field(default_factory=dict)
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    models_ready: set[tuple[str, str, str]] = field(default_factory=set)
    """(namespace, name, download Job) seen succeeded, in case the index lags the event."""

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())


def leader_priority(now: float | None = None) -> int:
    """kopf freezes all operators of equal priority, and pauses the lower ones: make the
    oldest replica the highest (it keeps leading through a rolling update), with a random
    tie-breaker for replicas started in the same second."""
    started = int(time.time() if now is None else now)
    return (2**40 - started) * 1000 + random.randrange(1000)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _isvc(body: kopf.Body | dict[str, Any]) -> InferenceService:
    data = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": dict(body.get("metadata") or {}),
        "spec": dict(body.get("spec") or {}),
    }
    meta = data["metadata"]
    data["metadata"] = {
        k: meta[k] for k in ("name", "namespace", "uid", "generation", "labels") if k in meta
    }
    try:
        return load_inference_service(data)
    except ValueError as exc:
        raise kopf.PermanentError(str(exc)) from None


def ensure_peering(kube: Kube, name: str, namespaces: tuple[str, ...]) -> None:
    """kopf needs its peering object to exist; create it (idempotently) rather than make
    every installation do it by hand. A CR cannot ship in the chart beside its own CRD."""
    if namespaces:
        targets = [
            (
                f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings",
                {
                    "apiVersion": "kopf.dev/v1",
                    "kind": "KopfPeering",
                    "metadata": {"name": name, "namespace": ns},
                },
            )
            for ns in namespaces
        ]
    else:
        targets = [
            (
                "/apis/kopf.dev/v1/clusterkopfpeerings",
                {
                    "apiVersion": "kopf.dev/v1",
                    "kind": "ClusterKopfPeering",
                    "metadata": {"name": name},
                },
            )
        ]
    for path, body in targets:
        try:
            kube.request("POST", path, body)
        except KubeError as exc:
            if exc.status != 409:  # 409: it exists already
                raise


def connection_info() -> kopf.ConnectionInfo:
    """kopf's connection from the official client's default configuration."""
    from kubernetes import client

    conf = client.Configuration.get_default_copy()
    auth = (conf.api_key or {}).get("authorization") or (conf.api_key or {}).get("BearerToken")
    scheme, _, token = (auth or "").partition(" ")
    if not conf.refresh_api_key_hook and auth and not token:
        scheme, token = "Bearer", auth
    return kopf.ConnectionInfo(
        server=conf.host,
        ca_path=conf.ssl_ca_cert,
        insecure=not conf.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=conf.cert_file,
        private_key_path=conf.key_file,
        username=conf.username or None,
        password=conf.password or None,
    )


def _plain(body: kopf.Body | dict[str, Any]) -> dict[str, Any]:
    """A detached dict copy of an InferenceService body (kopf's Body is a live view)."""
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": dict(body.get("metadata") or {}),
        "spec": dict(body.get("spec") or {}),
        "status": dict(body.get("status") or {}),
    }


def build_registry(options: OperatorOptions) -> kopf.OperatorRegistry:
    """All handlers on a fresh registry, closing over one per-operator state."""
    registry = kopf.OperatorRegistry()
    state = _State(options)
    isvc_resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=KOPF_PREFIX, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
        settings.posting.level = logging.WARNING  # Kubernetes Events only for problems
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.execution.max_workers = 16
        if options.peering:
            settings.peering.name = options.peering
            settings.peering.mandatory = True
            settings.peering.standalone = False
            settings.peering.priority = leader_priority()
        else:
            settings.peering.standalone = True

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        """The credentials ``load_config`` resolved (in-cluster, or the --kubeconfig given),
        not kopf's own guess, so the operator and its client always act as the same user."""
        return connection_info()

    # ---- indexes: kopf's watches, summarised, keyed by (namespace, InferenceService name) ----

    @kopf.index(*isvc_resource, id="isvc_bodies", registry=registry)
    def isvc_bodies(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): _plain(body)}

    @kopf.index(
        "apps", "v1", "deployments", id="child_deployments", labels=MANAGED, registry=registry
    )
    def child_deployments(
        namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Any, Any]:
        owner, role = labels.get(ENGINE_SELECTOR_LABEL), labels.get(ROLE_LABEL)
        return (
            {(namespace, owner): summarize_deployment(dict(body), role)} if owner and role else {}
        )

    @kopf.index("", "v1", "pods", id="child_pods", labels=MANAGED, registry=registry)
    def child_pods(
        namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Any, Any]:
        owner, role = labels.get(ENGINE_SELECTOR_LABEL), labels.get(ROLE_LABEL)
        return {(namespace, owner): summarize_pod(dict(body), role)} if owner and role else {}

    @kopf.index("batch", "v1", "jobs", id="child_jobs", labels=MANAGED, registry=registry)
    def child_jobs(
        namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Any, Any]:
        owner = labels.get(ENGINE_SELECTOR_LABEL)
        return {(namespace, owner): summarize_job(dict(body))} if owner else {}

    def children(
        key: tuple[str, str], topology: Topology, indexes: dict[str, kopf.Index]
    ) -> Children:
        job_name = download_job_name(topology) if topology.model.kind == "hf" else None
        return Children(
            deployments=list(indexes["child_deployments"].get(key, [])),
            pods=list(indexes["child_pods"].get(key, [])),
            jobs=[j for j in indexes["child_jobs"].get(key, []) if j.name == job_name],
        )

    def kube() -> Kube:
        assert state.kube is not None, "the client is created at startup"
        return state.kube

    @kopf.on.startup(registry=registry)
    def connect(**_: Any) -> None:
        from .kube import client

        state.kube = Kube(client.ApiClient())
        if options.peering:
            ensure_peering(state.kube, options.peering, options.namespaces)

    async def refresh_status(
        key: tuple[str, str], body: dict[str, Any], indexes: dict[str, kopf.Index]
    ) -> None:
        """Recompute status from the indexes and write it if it changed."""
        isvc = _isvc(body)
        topology = plan(isvc)
        previous = dict(body.get("status") or {})
        observed = state.applied_generation.get(key, previous.get("observedGeneration"))
        new = compute_status(
            isvc, topology, children(key, topology, indexes), observed, _now(), previous
        )
        if status_changed(previous, new):
            await asyncio.to_thread(kube().patch_status, key[0], key[1], new)

    async def reconcile(
        body: dict[str, Any], namespace: str, name: str, indexes: dict[str, kopf.Index], prune: bool
    ) -> None:
        key = (namespace, name)
        body = _plain(body)
        isvc = _isvc(body)
        topology = plan(isvc)
        async with state.lock(key):
            kids = children(key, topology, indexes)
            model_ready = (
                topology.model.kind != "hf"
                or any(j.succeeded for j in kids.jobs)
                or (namespace, name, download_job_name(topology)) in state.models_ready
            )
            manifests = render(
                isvc,
                RenderOptions(
                    image=options.render.image,
                    image_pull_policy=options.render.image_pull_policy,
                    model_ready=model_ready,
                ),
                topology,
            )

            def apply_all() -> None:
                k = kube()
                k.create_if_absent(
                    internal_credential_secret(isvc, topology, secrets.token_urlsafe(32))
                )
                for manifest in manifests:
                    k.apply(manifest)
                if prune:
                    wanted = {(m["kind"], m["metadata"]["name"]) for m in manifests}
                    for api_version, kind in PRUNABLE:
                        for existing in k.list(
                            api_version, kind, namespace, f"{ENGINE_SELECTOR_LABEL}={name}"
                        ):
                            if (kind, existing["metadata"]["name"]) not in wanted:
                                k.delete(
                                    {
                                        "apiVersion": api_version,
                                        "kind": kind,
                                        "metadata": existing["metadata"],
                                    }
                                )

            await asyncio.to_thread(apply_all)
            generation = int(body["metadata"].get("generation") or 0)
            state.applied_generation[key] = generation
            log.info(
                "[%s/%s] applied %d objects for generation %s",
                namespace,
                name,
                len(manifests),
                generation,
            )
            await refresh_status(key, body, indexes)

    def _indexes(kwargs: dict[str, Any]) -> dict[str, kopf.Index]:
        return {k: kwargs[k] for k in ("child_deployments", "child_pods", "child_jobs")}

    @kopf.on.create(*isvc_resource, registry=registry)
    async def created(body: kopf.Body, namespace: str, name: str, **kwargs: Any) -> None:
        await reconcile(body, namespace, name, _indexes(kwargs), prune=False)

    @kopf.on.update(*isvc_resource, field="spec", registry=registry)
    async def updated(body: kopf.Body, namespace: str, name: str, **kwargs: Any) -> None:
        await reconcile(body, namespace, name, _indexes(kwargs), prune=True)

    @kopf.on.resume(*isvc_resource, registry=registry)
    async def resumed(body: kopf.Body, namespace: str, name: str, **kwargs: Any) -> None:
        await reconcile(body, namespace, name, _indexes(kwargs), prune=True)

    @kopf.timer(
        *isvc_resource,
        interval=options.resync_seconds,
        initial_delay=options.resync_seconds,
        registry=registry,
    )
    async def resync(body: kopf.Body, namespace: str, name: str, **kwargs: Any) -> None:
        """Converge on a timer too: heals a hand-deleted child and catches a missed event.
        Also how engines appear once an hf:// download finishes."""
        await reconcile(body, namespace, name, _indexes(kwargs), prune=False)

    @kopf.on.delete(*isvc_resource, optional=True, registry=registry)
    def deleted(namespace: str, name: str, **_: Any) -> None:
        """No finalizer (optional=True): forget our bookkeeping; the GC removes the children."""
        state.applied_generation.pop((namespace, name), None)
        state.locks.pop((namespace, name), None)
        state.models_ready -= {k for k in state.models_ready if k[:2] == (namespace, name)}

    async def on_child_event(
        event: kopf.RawEvent, namespace: str, labels: kopf.Labels, kwargs: dict[str, Any]
    ) -> None:
        owner = labels.get(ENGINE_SELECTOR_LABEL)
        bodies = kwargs["isvc_bodies"].get((namespace, owner), [])
        if not owner or not bodies:
            return
        key = (namespace, owner)
        body = next(iter(bodies))
        obj = event.get("object") or {}
        if (
            obj.get("kind") == "Job"
            and (namespace, owner, obj["metadata"]["name"]) not in state.models_ready
        ):
            job = summarize_job(obj)
            if job.succeeded:  # the model is in the cache: now render the engines
                state.models_ready.add((namespace, owner, job.name))
                await reconcile(body, namespace, owner, _indexes(kwargs), prune=False)
                return
        async with state.lock(key):
            # The index may lag our own status write; refresh_status compares with it, which
            # costs at most one redundant patch.
            await refresh_status(key, body, _indexes(kwargs))

    @kopf.on.event("apps", "v1", "deployments", labels=MANAGED, registry=registry)
    async def deployment_event(
        event: kopf.RawEvent, namespace: str, labels: kopf.Labels, **kwargs: Any
    ) -> None:
        await on_child_event(event, namespace, labels, kwargs)

    @kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry)
    async def pod_event(
        event: kopf.RawEvent, namespace: str, labels: kopf.Labels, **kwargs: Any
    ) -> None:
        await on_child_event(event, namespace, labels, kwargs)

    @kopf.on.event("batch", "v1", "jobs", labels=MANAGED, registry=registry)
    async def job_event(
        event: kopf.RawEvent, namespace: str, labels: kopf.Labels, **kwargs: Any
    ) -> None:
        await on_child_event(event, namespace, labels, kwargs)

    return registry
