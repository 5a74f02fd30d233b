"""Reconcile one InferenceService: render, server-side apply, prune, and recompute its status.
The I/O edge: everything it decides comes from the pure core (topology, render, status).

Level-based: every reconcile renders the whole desired state from the spec and
server-side applies it (a no-op when nothing changed), so a restart, a missed event or a
hand-deleted child all converge the same way. Status is recomputed from the indexes of the
children on each child event and after each apply, and written only when it changes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import kopf

from .admission import admit, free_gpus
from .autoscaler.objects import KEDA_API_VERSION
from .bodies import inference_service_of, plain_body
from .indexes import (
    children_of,
    gpu_pods,
    index_kwargs,
    largest_node_gpus,
    node_gpus_by_name,
    owner_of,
)
from .kube import Kube, KubeError
from .render.manifests import render
from .render.meta import ADMISSION_GATE, Manifest, cache_claim_name, cached_model_key
from .render.options import RenderOptions
from .render.security import internal_credential_secret
from .rollout import hold_old_layout
from .spec.inference_service import InferenceService
from .state import Key, OperatorOptions, OperatorState
from .status.children import Children, Facts
from .status.compute import as_patch, compute_status, parse_status, status_changed
from .status.conditions import model_ready
from .status.events import events
from .topology import ENGINE_SELECTOR_LABEL, Topology, plan

# Kinds that a spec change can make obsolete; the rest always exist for every spec.
PRUNABLE = (
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("batch/v1", "Job"),
    (KEDA_API_VERSION, "ScaledObject"),
)

REFRESH_DELAY_SECONDS = 0.3
"""How long a child's event waits for the events that follow it (one refresh for a burst)."""

log = logging.getLogger("tandem.operator")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _facts(state: OperatorState, key: Key, indexes: dict[str, kopf.Index]) -> Facts:
    return Facts(
        apply_error=state.apply_errors.get(key),
        largest_node_gpus=largest_node_gpus(indexes),
        planner=state.planner_reports.get(key),
    )


def render_options(
    options: OperatorOptions, isvc: InferenceService, topology: Topology, kids: Children
) -> RenderOptions:
    """The operator's render settings, plus what the children say about the model: whether
    it is ready (engines may be rendered) and already cached (no download Job)."""
    claim = next((c for c in kids.claims if c.name == cache_claim_name(isvc)), None)
    return replace(
        options.render,
        model_ready=model_ready(isvc, topology, kids),
        model_cached=topology.model.kind == "hf"
        and claim is not None
        and claim.cached_model == cached_model_key(topology),
        hold_old_layout=hold_old_layout(topology, kids.pods),
    )


async def refresh_status(
    state: OperatorState, key: Key, body: dict[str, Any], indexes: dict[str, kopf.Index]
) -> None:
    """Admit what fits (gang admission), recompute status from the indexes, write it if it
    changed, post an Event per new cause."""
    isvc = inference_service_of(body)
    topology = plan(isvc)
    kids = children_of(key, topology, indexes)
    free = free_gpus(node_gpus_by_name(indexes), gpu_pods(indexes))
    admission = admit(kids.pods, free)
    if admission.admit:
        log.info("[%s/%s] admitting %s (free GPUs per node %s)", *key, admission.admit, free)
    for pod in admission.admit:
        await state.write(state.client().remove_gate, key[0], pod, ADMISSION_GATE)
    uid = body["metadata"].get("uid")
    written = state.statuses.get(key)
    previous = written[1] if written and written[0] == uid else parse_status(body.get("status"))
    observed = state.applied_generation.get(key, previous.observed_generation if previous else None)
    new = compute_status(
        isvc,
        topology,
        kids,
        observed,
        _now(),
        previous,
        replace(_facts(state, key, indexes), held=admission.held),
    )
    if not status_changed(previous, new):
        return
    kube = state.client()
    await state.write(kube.patch_status, key[0], key[1], as_patch(new))
    state.statuses[key] = (uid, new)
    posted = state.posted.setdefault(key, {})
    for event in events(previous, new):
        if posted.get(event.condition) == (event.status, event.reason):
            continue  # the index lagged our own write: posted already
        posted[event.condition] = (event.status, event.reason)
        await state.write(kube.post_event, body, event.type, event.reason, event.message, _now())
        state.metrics.events.labels(event.type, event.reason).inc()


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
    body = plain_body(body)
    isvc = inference_service_of(body)
    topology = plan(isvc)
    async with state.lock(key):
        kids = children_of(key, topology, indexes)
        options = render_options(state.options, isvc, topology, kids)
        manifests = render(isvc, options, topology)
        # the engines' shared internal credential: created once, never rotated by a re-apply
        credential = internal_credential_secret(isvc, topology, secrets.token_urlsafe(32))
        try:
            with state.metrics.reconcile():
                await asyncio.to_thread(
                    _apply_all, state.client(), credential, manifests, namespace, name, prune
                )
        except KubeError as exc:
            state.apply_errors[key] = exc.message
            await refresh_status(state, key, body, indexes)
            raise kopf.TemporaryError(exc.message, delay=30) from None
        state.apply_errors.pop(key, None)
        state.held[key] = options.hold_old_layout
        generation = int(body["metadata"].get("generation") or 0)
        state.applied_generation[key] = generation
        await refresh_status(state, key, body, indexes)
        log.info(  # after the status and its Events: the line says the reconcile is whole
            "[%s/%s] applied %d objects for generation %s",
            namespace,
            name,
            len(manifests),
            generation,
        )


def _apply_all(
    kube: Kube,
    credential: Manifest,
    manifests: list[Manifest],
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


def _render_changed(
    state: OperatorState, key: Key, body: dict[str, Any], indexes: dict[str, kopf.Index]
) -> bool:
    """Whether the children changed what is rendered: the model reached the cache (now the
    engines), or a KV-layout rollout's hold starts or ends (a new pair is Ready)."""
    isvc = inference_service_of(body)
    topology = plan(isvc)
    kids = children_of(key, topology, indexes)
    held = state.held.get(key)
    if held is not None and held != hold_old_layout(topology, kids.pods):
        return True
    engines = {d.role for d in kids.deployments} - {"proxy"}
    return topology.model.kind == "hf" and model_ready(isvc, topology, kids) and not engines


async def on_child_event(
    event: kopf.RawEvent, namespace: str, labels: kopf.Labels, memo: kopf.Memo, kwargs: Any
) -> None:
    """Schedule one status refresh for the owner, unless one is pending (it will read this
    event too). Returning at once keeps kopf's per-object workers free, so every child's
    event reaches the indexes in the watch's order: a refresh never sees an old pod gone
    but not yet the new pod that replaced it. Bursts (a rollout, 1,000 services starting)
    cost one status computation per service, not one per pod event."""
    owner = owner_of(labels)
    state: OperatorState = memo.state
    key = (namespace, owner or "")
    if not owner or key in state.refreshes:
        return
    bodies, indexes = kwargs["isvc_bodies"], index_kwargs(kwargs)
    state.refreshes[key] = asyncio.create_task(_refresh_soon(state, key, bodies, indexes))


async def _refresh_soon(
    state: OperatorState, key: Key, bodies: kopf.Index, indexes: dict[str, kopf.Index]
) -> None:
    await asyncio.sleep(REFRESH_DELAY_SECONDS)
    state.refreshes.pop(key, None)  # an event from now on schedules the next refresh
    found = list(bodies.get(key, []))
    if not found:
        return
    body = found[0]
    try:
        if _render_changed(state, key, body, indexes):
            await reconcile(state, body, key[0], key[1], indexes, prune=False)
            return
        async with state.lock(key):
            await refresh_status(state, key, body, indexes)
    except kopf.TemporaryError:
        pass  # recorded in the status; the resync retries
    except Exception:  # a task's error would otherwise go unseen
        log.exception("[%s/%s] status refresh failed", *key)
