"""kopf handlers: apply the rendered children, recompute status from them. The I/O edge.

Level-based: every reconcile renders the whole desired state from the spec and
server-side applies it (a no-op when nothing changed), so a restart, a missed event or a
hand-deleted child all converge the same way. Status comes from in-memory indexes of the
children (Deployments, Pods, Jobs) that kopf keeps from its watches, recomputed on each
child event and on a timer, and written only when it changes.

kopf's own bookkeeping (handler progress, the last handled spec) lives in annotations under
``kopf.tandem.dev/``, never in ``status``, which belongs to the users' view. Every child has
a controller owner reference and the garbage collector removes it with the InferenceService
(except a retained model cache, which outlives it on purpose).

The handlers are module-level, kopf's idiom; the operator's state (options, the client,
per-object bookkeeping) is one :class:`OperatorState` that ``kopf.run(memo=...)`` hands to
every handler as ``memo.state``. What the status says is decided in ``status.py`` alone.
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

from .autoscaler.loop import run_planner
from .autoscaler.objects import KEDA_API_VERSION
from .autoscaler.planner import PlannerState
from .kube import Kube, KubeError
from .render.manifests import render
from .render.meta import MANAGER, ROLE_LABEL, cache_claim_name, cached_model_key, download_job_name
from .render.options import RenderOptions
from .render.security import internal_credential_secret
from .spec.inference_service import GROUP, PLURAL, VERSION, InferenceService, load_inference_service
from .spec.roles import GPU_RESOURCE
from .status.children import (
    AutoscalerSummary,
    Children,
    Facts,
    pod_role,
    scaled_object_health,
    summarize_autoscaler,
    summarize_claim,
    summarize_deployment,
    summarize_job,
    summarize_pod,
)
from .status.compute import as_patch, compute_status, parse_status, status_changed
from .status.conditions import model_ready
from .status.events import events
from .topology import ENGINE_SELECTOR_LABEL, Topology, plan

MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
KOPF_PREFIX = "kopf.tandem.dev"
# Kinds that a spec change can make obsolete; the rest always exist for every spec.
PRUNABLE = (
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("batch/v1", "Job"),
    (KEDA_API_VERSION, "ScaledObject"),
)
PLANNER_INTERVAL_SECONDS = 15.0

log = logging.getLogger("tandem.operator")


@dataclass(frozen=True)
class OperatorOptions:
    render: RenderOptions = RenderOptions()
    resync_seconds: float = 60.0
    peering: str | None = None
    """kopf peering object for leader election among replicas; None runs standalone."""
    namespaces: tuple[str, ...] = ()
    """Watched namespaces; empty is cluster-wide (and a ClusterKopfPeering)."""
    planner: bool = True
    """Run the Planner backend's loop; off when something else drives
    :func:`~.autoscaler.loop.run_planner` (``bench/autoscale.py --cluster``, in simulated time)."""


Key = tuple[str, str]


@dataclass
class OperatorState:
    """The operator's state, shared by every handler through ``memo.state``."""

    options: OperatorOptions
    kube: Kube | None = None
    applied_generation: dict[Key, int] = field(default_factory=dict)
    apply_errors: dict[Key, str] = field(default_factory=dict)
    """The API server's message for an InferenceService whose last apply failed."""
    posted: dict[Key, dict[str, tuple[str, str]]] = field(default_factory=dict)
    """(status, reason) per condition type last posted as an Event: no repeats on resync."""
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    planner: dict[Key, PlannerState] = field(default_factory=dict)
    """The SLO planner's state (its stabilisation window) per InferenceService."""

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def client(self) -> Kube:
        assert self.kube is not None, "the client is created at startup"
        return self.kube

    def forget(self, key: Key) -> None:
        for table in (
            self.applied_generation,
            self.apply_errors,
            self.posted,
            self.locks,
            self.planner,
        ):
            table.pop(key, None)


def operator_memo(options: OperatorOptions) -> kopf.Memo:
    """kopf gives each object a shallow copy of this memo: they all share one state."""
    return kopf.Memo(state=OperatorState(options))


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


ISVC = (GROUP, VERSION, PLURAL)
INDEXES = (
    "child_deployments",
    "child_pods",
    "child_jobs",
    "child_claims",
    "child_autoscalers",
    "child_scaledobjects",
    "node_gpus",
)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    options: OperatorOptions = memo.state.options
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
    # Events come from status.py's condition changes, once each; kopf would post one per
    # failed retry of a handler (an event storm while an apply keeps failing).
    settings.posting.enabled = False
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


@kopf.on.startup()
def connect(memo: kopf.Memo, **_: Any) -> None:
    from .kube import client

    state: OperatorState = memo.state
    state.kube = Kube(client.ApiClient())
    if state.options.peering:
        ensure_peering(state.kube, state.options.peering, state.options.namespaces)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """The credentials ``load_config`` resolved (in-cluster, or the --kubeconfig given),
    not kopf's own guess, so the operator and its client always act as the same user."""
    return connection_info()


# ---- indexes: kopf's watches, summarised, keyed by (namespace, InferenceService name) ----


@kopf.index(*ISVC, id="isvc_bodies")
def isvc_bodies(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): _plain(body)}


def _owner(labels: kopf.Labels) -> str | None:
    return labels.get(ENGINE_SELECTOR_LABEL)


@kopf.index("apps", "v1", "deployments", id="child_deployments", labels=MANAGED)
def child_deployments(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner, role = _owner(labels), labels.get(ROLE_LABEL)
    return {(namespace, owner): summarize_deployment(dict(body), role)} if owner and role else {}


@kopf.index("", "v1", "pods", id="child_pods", labels=MANAGED)
def child_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    owner, role = _owner(labels), pod_role(dict(labels))
    return {(namespace, owner): summarize_pod(dict(body), role)} if owner and role else {}


@kopf.index("batch", "v1", "jobs", id="child_jobs", labels=MANAGED)
def child_jobs(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    owner = _owner(labels)
    return {(namespace, owner): summarize_job(dict(body))} if owner else {}


@kopf.index("", "v1", "persistentvolumeclaims", id="child_claims", labels=MANAGED)
def child_claims(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    owner = _owner(labels)
    return {(namespace, owner): summarize_claim(dict(body))} if owner else {}


@kopf.index("autoscaling", "v2", "horizontalpodautoscalers", id="child_autoscalers", labels=MANAGED)
def child_autoscalers(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner, role = _owner(labels), labels.get(ROLE_LABEL)
    return {(namespace, owner): summarize_autoscaler(dict(body), role)} if owner and role else {}


@kopf.index("keda.sh", "v1alpha1", "scaledobjects", id="child_scaledobjects", labels=MANAGED)
def child_scaledobjects(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    owner, role = _owner(labels), labels.get(ROLE_LABEL)
    if not (owner and role):
        return {}
    return {(namespace, owner): AutoscalerSummary(role, *scaled_object_health(dict(body)))}


@kopf.index("", "v1", "nodes", id="node_gpus")
def node_gpus(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Allocatable GPUs per node: a pod asking for more than the largest is Unschedulable."""
    allocatable = (body.get("status") or {}).get("allocatable") or {}
    return {None: int(allocatable.get(GPU_RESOURCE) or 0)}


def _children(key: Key, topology: Topology, indexes: dict[str, kopf.Index]) -> Children:
    job_name = download_job_name(topology) if topology.model.kind == "hf" else None
    return Children(
        deployments=list(indexes["child_deployments"].get(key, [])),
        pods=list(indexes["child_pods"].get(key, [])),
        jobs=[j for j in indexes["child_jobs"].get(key, []) if j.name == job_name],
        claims=list(indexes["child_claims"].get(key, [])),
        autoscalers=[
            *indexes["child_autoscalers"].get(key, []),
            *indexes["child_scaledobjects"].get(key, []),
        ],
    )


def _facts(state: OperatorState, key: Key, indexes: dict[str, kopf.Index]) -> Facts:
    gpus = list(indexes["node_gpus"].get(None, []))
    return Facts(
        apply_error=state.apply_errors.get(key), largest_node_gpus=max(gpus) if gpus else None
    )


def _indexes(kwargs: dict[str, Any]) -> dict[str, kopf.Index]:
    return {k: kwargs[k] for k in INDEXES}


async def refresh_status(
    state: OperatorState, key: Key, body: dict[str, Any], indexes: dict[str, kopf.Index]
) -> None:
    """Recompute status from the indexes, write it if it changed, post an Event per changed
    condition."""
    isvc = _isvc(body)
    topology = plan(isvc)
    previous = parse_status(body.get("status"))
    observed = state.applied_generation.get(key, previous.observed_generation if previous else None)
    new = compute_status(
        isvc,
        topology,
        _children(key, topology, indexes),
        observed,
        _now(),
        previous,
        _facts(state, key, indexes),
    )
    if not status_changed(previous, new):
        return
    kube = state.client()
    await asyncio.to_thread(kube.patch_status, key[0], key[1], as_patch(new))
    posted = state.posted.setdefault(key, {})
    for event in events(previous, new):
        if posted.get(event.condition) == (event.status, event.reason):
            continue  # the index lagged our own write: posted already
        posted[event.condition] = (event.status, event.reason)
        await asyncio.to_thread(
            kube.post_event, body, event.type, event.reason, event.message, _now()
        )


async def reconcile(
    state: OperatorState,
    body: kopf.Body | dict[str, Any],
    namespace: str,
    name: str,
    indexes: dict[str, kopf.Index],
    prune: bool,
) -> None:
    """Render the whole desired state and server-side apply it; a failed apply is recorded
    for the status (the API server's message) and retried by kopf."""
    key = (namespace, name)
    body = _plain(body)
    isvc = _isvc(body)
    topology = plan(isvc)
    options = state.options
    async with state.lock(key):
        kids = _children(key, topology, indexes)
        claim = next((c for c in kids.claims if c.name == cache_claim_name(isvc)), None)
        manifests = render(
            isvc,
            RenderOptions(
                image=options.render.image,
                image_pull_policy=options.render.image_pull_policy,
                gang_scheduling=options.render.gang_scheduling,
                model_ready=model_ready(isvc, topology, kids),
                model_cached=topology.model.kind == "hf"
                and claim is not None
                and claim.cached_model == cached_model_key(topology),
            ),
            topology,
        )
        # the engines' shared internal credential: created once, never rotated by a re-apply
        credential = internal_credential_secret(isvc, topology, secrets.token_urlsafe(32))
        try:
            await asyncio.to_thread(
                _apply_all, state.client(), credential, manifests, namespace, name, prune
            )
        except KubeError as exc:
            state.apply_errors[key] = exc.message
            await refresh_status(state, key, body, indexes)
            raise kopf.TemporaryError(exc.message, delay=30) from None
        state.apply_errors.pop(key, None)
        generation = int(body["metadata"].get("generation") or 0)
        state.applied_generation[key] = generation
        log.info(
            "[%s/%s] applied %d objects for generation %s",
            namespace,
            name,
            len(manifests),
            generation,
        )
        await refresh_status(state, key, body, indexes)


def _apply_all(
    kube: Kube,
    credential: dict[str, Any],
    manifests: list[dict[str, Any]],
    namespace: str,
    name: str,
    prune: bool,
) -> None:
    kube.create_if_absent(credential)
    for manifest in manifests:
        kube.apply(manifest)
    if not prune:
        return
    wanted = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    for api_version, kind in PRUNABLE:
        selector = f"{ENGINE_SELECTOR_LABEL}={name}"
        # ok_missing: KEDA's CRDs may not be installed
        for existing in kube.list(api_version, kind, namespace, selector, ok_missing=True):
            if (kind, existing["metadata"]["name"]) not in wanted:
                kube.delete(
                    {"apiVersion": api_version, "kind": kind, "metadata": existing["metadata"]}
                )


@kopf.on.create(*ISVC)
async def created(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    await reconcile(memo.state, body, namespace, name, _indexes(kwargs), prune=False)


@kopf.on.update(*ISVC, field="spec")
async def updated(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    await reconcile(memo.state, body, namespace, name, _indexes(kwargs), prune=True)


@kopf.on.resume(*ISVC)
async def resumed(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    await reconcile(memo.state, body, namespace, name, _indexes(kwargs), prune=True)


@kopf.daemon(*ISVC, id="resync", cancellation_timeout=1.0)
async def resync(
    body: kopf.Body,
    namespace: str,
    name: str,
    memo: kopf.Memo,
    stopped: kopf.DaemonStopped,
    **kwargs: Any,
) -> None:
    """Converge every ``--resync-seconds`` too: heals a hand-deleted child, catches a missed
    event, retries a failed apply. ``body`` is live in a daemon: each pass sees the latest."""
    state: OperatorState = memo.state
    while not await stopped.wait(state.options.resync_seconds):
        try:
            await reconcile(state, body, namespace, name, _indexes(kwargs), prune=False)
        except kopf.TemporaryError:
            pass  # recorded in the status; the next pass retries


@kopf.timer(*ISVC, interval=PLANNER_INTERVAL_SECONDS, when=lambda spec, **_: bool(spec.get("slo")))
async def plan_pools(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The Planner backend: size prefill and decode for spec.slo from live metrics."""
    state: OperatorState = memo.state
    if not state.options.planner:
        return
    key = (namespace, name)
    try:
        decision = await asyncio.to_thread(
            run_planner, state.client(), _isvc(body), state.planner.get(key), time.monotonic()
        )
    except (KubeError, OSError, KeyError, ValueError) as exc:
        log.warning("[%s/%s] planner: %s", namespace, name, exc)
        return
    state.planner[key] = decision.state
    log.info(
        "[%s/%s] planner: %.2f req/s, isl %.0f, osl %.0f -> %d prefill, %d decode",
        namespace,
        name,
        decision.load.rate,
        decision.load.isl,
        decision.load.osl,
        decision.prefill,
        decision.decode,
    )


@kopf.on.delete(*ISVC, optional=True)
def deleted(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """No finalizer of its own (optional=True): forget our bookkeeping; the GC does the rest."""
    memo.state.forget((namespace, name))


async def on_child_event(
    event: kopf.RawEvent, namespace: str, labels: kopf.Labels, memo: kopf.Memo, kwargs: Any
) -> None:
    owner = _owner(labels)
    bodies = kwargs["isvc_bodies"].get((namespace, owner), [])
    if not owner or not bodies:
        return
    state: OperatorState = memo.state
    key = (namespace, owner)
    body = next(iter(bodies))
    indexes = _indexes(kwargs)
    if (event.get("object") or {}).get("kind") == "Job":
        isvc = _isvc(body)
        topology = plan(isvc)
        kids = _children(key, topology, indexes)
        engines = {d.role for d in kids.deployments} - {"proxy"}
        if model_ready(isvc, topology, kids) and not engines:
            # the model is in the cache: now render the engines
            await reconcile(state, body, namespace, owner, indexes, prune=False)
            return
    async with state.lock(key):
        # The index may lag our own status write; refresh_status compares with it, which
        # costs at most one redundant patch.
        await refresh_status(state, key, body, indexes)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "pods", labels=MANAGED)
@kopf.on.event("batch", "v1", "jobs", labels=MANAGED)
@kopf.on.event("", "v1", "persistentvolumeclaims", labels=MANAGED)
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=MANAGED)
@kopf.on.event("keda.sh", "v1alpha1", "scaledobjects", labels=MANAGED)
async def child_event(
    event: kopf.RawEvent, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **kwargs: Any
) -> None:
    await on_child_event(event, namespace, labels, memo, kwargs)
