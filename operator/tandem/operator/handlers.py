"""kopf handlers: the operator's entry points. The I/O edge.

kopf calls these: at startup (settings, the client, peering), to log in, on an
InferenceService's create, spec update, resume and delete, on a resync daemon and the
planner's timer, and on every child's event. Each one hands over to ``reconcile.py`` (apply
and status) or ``autoscaler/loop.py`` (the planner's round); kopf's indexes, which those
read, are in ``indexes.py``.

kopf's own bookkeeping (handler progress, the last handled spec) lives in annotations under
``kopf.tandem.dev/``, never in ``status``, which belongs to the users' view. Every child has
a controller owner reference and the garbage collector removes it with the InferenceService
(except a retained model cache, which outlives it on purpose).

The handlers are module-level, kopf's idiom; the operator's state (options, the client,
per-object bookkeeping) is one :class:`~.state.OperatorState` that ``kopf.run(memo=...)``
hands to every handler as ``memo.state``. What the status says is decided in the
``status`` package alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from .autoscaler.loop import run_planner
from .bodies import ISVC, inference_service_of, plain_body
from .indexes import MANAGED, index_kwargs
from .kube import Kube, KubeError
from .peering import ensure_peering, leader_priority
from .reconcile import on_child_event, reconcile, refresh_status
from .state import OperatorOptions, OperatorState
from .status.children import PlannerReport

KOPF_PREFIX = "kopf.tandem.dev"
PLANNER_INTERVAL_SECONDS = 15.0

log = logging.getLogger("tandem.operator")


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


def operator_memo(options: OperatorOptions) -> kopf.Memo:
    """kopf gives each object a shallow copy of this memo: they all share one state."""
    return kopf.Memo(state=OperatorState(options))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    options: OperatorOptions = memo.state.options
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
    # Events come from the status's condition changes, once each; kopf would post one per
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
    if state.options.metrics_address:
        state.metrics.watch_queue(lambda: len(state.refreshes))
        state.metrics.serve(state.options.metrics_address)
    log.info(
        "started: namespaces %s, peering %s",
        ",".join(state.options.namespaces) or "all",
        state.options.peering or "none (standalone)",
    )


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """The credentials ``load_config`` resolved (in-cluster, or the --kubeconfig given),
    not kopf's own guess, so the operator and its client always act as the same user."""
    return connection_info()


@kopf.on.create(*ISVC)
async def created(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    await reconcile(memo.state, body, namespace, name, index_kwargs(kwargs), prune=False)


@kopf.on.update(*ISVC, field="spec")
async def updated(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    await reconcile(memo.state, body, namespace, name, index_kwargs(kwargs), prune=True)


@kopf.on.resume(*ISVC)
async def resumed(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    await reconcile(memo.state, body, namespace, name, index_kwargs(kwargs), prune=True)


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
            await reconcile(state, body, namespace, name, index_kwargs(kwargs), prune=False)
        except kopf.TemporaryError:
            pass  # recorded in the status; the next pass retries


@kopf.timer(*ISVC, interval=PLANNER_INTERVAL_SECONDS, when=lambda spec, **_: bool(spec.get("slo")))
async def plan_pools(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    """The Planner backend: size prefill and decode for spec.slo from live metrics."""
    state: OperatorState = memo.state
    if not state.options.planner:
        return
    key = (namespace, name)
    try:
        decision = await asyncio.to_thread(
            run_planner,
            state.client(),
            inference_service_of(body),
            state.planner.get(key),
            time.monotonic(),
        )
    except (KubeError, OSError, KeyError, ValueError) as exc:
        # a condition, not only a log line: AutoscalingActive=False PlannerFailing
        log.warning("[%s/%s] planner: %s", namespace, name, exc)
        state.planner_reports[key] = PlannerReport(False, f"{type(exc).__name__}: {exc}")
    else:
        state.planner[key] = decision.state
        message = (
            f"{decision.load.rate:.2f} req/s, isl {decision.load.isl:.0f}, "
            f"osl {decision.load.osl:.0f} -> {decision.prefill} prefill, {decision.decode} decode"
        )
        log.info("[%s/%s] planner: %s", namespace, name, message)
        sized = f"sized {decision.prefill} prefill, {decision.decode} decode for the SLO"
        state.planner_reports[key] = PlannerReport(True, sized)
    async with state.lock(key):
        await refresh_status(state, key, plain_body(body), index_kwargs(kwargs))


@kopf.on.delete(*ISVC, optional=True)
async def deleted(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """No finalizer of its own (optional=True): forget our bookkeeping; the GC does the rest."""
    memo.state.forget((namespace, name))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=MANAGED)
@kopf.on.event("", "v1", "pods", labels=MANAGED)
@kopf.on.event("batch", "v1", "jobs", labels=MANAGED)
@kopf.on.event("", "v1", "persistentvolumeclaims", labels=MANAGED)
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=MANAGED)
@kopf.on.event("keda.sh", "v1alpha1", "scaledobjects", labels=MANAGED)
async def child_event(
    event: kopf.RawEvent, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **kwargs: Any
) -> None:
    await on_child_event(event, namespace, labels, memo, kwargs)
