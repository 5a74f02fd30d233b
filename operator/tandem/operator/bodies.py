"""InferenceService bodies as kopf delivers them, made into plain dicts and typed specs."""

from __future__ import annotations

from typing import Any

import kopf

from .spec.inference_service import GROUP, PLURAL, VERSION, InferenceService, load_inference_service

ISVC = (GROUP, VERSION, PLURAL)


def plain_body(body: kopf.Body | dict[str, Any]) -> dict[str, Any]:
    """A detached dict copy of an InferenceService body (kopf's Body is a live view)."""
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": dict(body.get("metadata") or {}),
        "spec": dict(body.get("spec") or {}),
        "status": dict(body.get("status") or {}),
    }


def inference_service_of(body: kopf.Body | dict[str, Any]) -> InferenceService:
    """The typed InferenceService; a spec the loader rejects is a permanent error (kopf
    does not retry it until the spec changes)."""
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
