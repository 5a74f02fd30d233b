"""Helpers for the operator's tests: an InferenceService as the API server hands it over."""

from __future__ import annotations

from typing import Any

from tandem.operator.spec.inference_service import load_inference_service

UID = "0b5a6e0e-6f5b-4a57-9d55-7a0f4d8f3c11"


def isvc(generation: int = 1, **spec: Any):
    body = {"model": {"name": "tiny", "uri": "/models/tiny"}, **spec}
    return load_inference_service(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "ml", "uid": UID, "generation": generation},
            "spec": body,
        }
    )


def by_kind_name(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}
