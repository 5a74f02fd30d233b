"""Kubernetes' own schemas for pod fields, generated from the official client's models.

The CRD embeds tolerations, affinity, volumes, containers... with the schemas Kubernetes
itself publishes (the ``kubernetes`` client's models are generated from the API server's
OpenAPI document), so the API server rejects a malformed toleration at admission instead of
the operator's apply failing later. Descriptions are left out: they would make the CRD
several times larger and ``kubectl explain`` links to Kubernetes' own documentation anyway.
"""

from __future__ import annotations

import datetime
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Union

from kubernetes.client import models
from pydantic import BaseModel

# Map values that are resource.Quantity in Kubernetes' OpenAPI (the client types them str).
QUANTITY_MAPS = frozenset({"limits", "requests", "capacity", "overhead"})
INT_OR_STRING = {"x-kubernetes-int-or-string": True}


@dataclass(frozen=True)
class KubeSchema:
    """Marks a spec field whose CRD schema is a Kubernetes type: ``KubeSchema("V1Toleration",
    list_of=True)``. ``crd.py`` replaces the field's schema with :func:`kube_schema`'s."""

    model: str
    list_of: bool = False
    map_of: bool = False

    def schema(self) -> dict[str, Any]:
        item = kube_schema(self.model)
        if self.list_of:
            return {"type": "array", "items": item}
        if self.map_of:
            return {"type": "object", "additionalProperties": item}
        return item


def _unwrap(annotation: Any) -> Any:
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return args
            annotation = args[0]
        else:
            return annotation


def _type(annotation: Any, field: str) -> dict[str, Any]:
    annotation = _unwrap(annotation)
    if isinstance(annotation, list):  # Union[int, str]: IntOrString
        return dict(INT_OR_STRING)
    origin = typing.get_origin(annotation)
    if origin in (list, typing.List):  # noqa: UP006
        (item,) = typing.get_args(annotation)
        return {"type": "array", "items": _type(item, field)}
    if origin in (dict, typing.Dict):  # noqa: UP006
        _, value = typing.get_args(annotation)
        if field in QUANTITY_MAPS:
            return {"type": "object", "additionalProperties": dict(INT_OR_STRING)}
        return {"type": "object", "additionalProperties": _type(value, field)}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model(annotation)
    if annotation is datetime.datetime:
        return {"type": "string", "format": "date-time"}
    if annotation is str and field == "size_limit":
        return dict(INT_OR_STRING)  # resource.Quantity
    simple = {bool: "boolean", int: "integer", float: "number", str: "string", bytes: "string"}
    if annotation in simple:
        return {"type": simple[annotation]}
    if annotation is object or annotation is Any:
        return {"x-kubernetes-preserve-unknown-fields": True}
    raise TypeError(f"no schema for {annotation!r} ({field})")


def _model(model: type[BaseModel]) -> dict[str, Any]:
    attribute_map: dict[str, str] = getattr(model, "attribute_map", {})
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, info in model.model_fields.items():
        key = attribute_map.get(name, name)
        properties[key] = _type(info.annotation, name)
        if info.is_required():
            required.append(key)
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


@functools.cache
def _cached(name: str) -> dict[str, Any]:
    return _model(getattr(models, name))


def kube_schema(name: str) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a Kubernetes type, e.g. ``"V1Toleration"``."""
    import copy

    return copy.deepcopy(_cached(name))
