"""The InferenceService CRD, generated from the spec models (``tandem.operator.spec``).

``python -m tandem.operator.crd > crds/inferenceservices.tandem.dev.yaml`` writes it; a unit
test keeps that file, and the Helm chart's template, equal to this output. The schema is
structural (every field typed, no ``$ref``), carries the spec's defaults, and each model's
:class:`~tandem.operator.spec.rules.Rule` becomes an ``x-kubernetes-validations`` CEL rule.
"""

from __future__ import annotations

import copy
import sys
import types
import typing
from typing import Any, Literal, Union

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .kubeschema import KubeSchema
from .spec import inference_service as s
from .spec.rules import SpecModel
from .spec.status import InferenceServiceStatus

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefill.replicas",
        "description": "prefill engines ready/desired",
    },
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.decode.replicas",
        "description": "decode (or aggregated) engines ready/desired",
    },
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "description": "why the service is (not) Ready; kubectl describe shows the message",
    },
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

SCALE = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.decode.ready",
    "labelSelectorPath": ".status.decodeSelector",
}

NAME_MAX = s.NAME_MAX
CRD_NAME = f"{s.PLURAL}.{s.GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"


def _is_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def type_schema(annotation: Any) -> dict[str, Any]:
    """OpenAPI v3 (structural) schema of a Python annotation."""
    annotation, _ = _is_optional(annotation)
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return {"x-kubernetes-preserve-unknown-fields": True}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_schema(annotation)
    if origin is Literal:
        values = list(typing.get_args(annotation))
        return {"type": "string", "enum": values}
    if origin is list:
        (item,) = typing.get_args(annotation)
        return {"type": "array", "items": type_schema(item)}
    if origin is tuple and typing.get_args(annotation)[1:] == (...,):  # tuple[X, ...]
        return {"type": "array", "items": type_schema(typing.get_args(annotation)[0])}
    if origin is dict:
        _, value = typing.get_args(annotation)
        if value is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": type_schema(value)}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation in simple:
        return {"type": simple[annotation]}
    raise TypeError(f"no schema for {annotation!r}")


def _constraints(info: FieldInfo, array: bool = False) -> dict[str, Any]:
    """The field's bounds as OpenAPI keywords: a list's lengths are ``minItems``/``maxItems``
    (which CEL's cost estimate needs), a string's ``minLength``/``maxLength`` and ``pattern``."""
    out: dict[str, Any] = {}
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Ge):
            out["minimum"] = meta.ge
        elif isinstance(meta, annotated_types.Gt):
            out["minimum"], out["exclusiveMinimum"] = meta.gt, True
        elif isinstance(meta, annotated_types.Le):
            out["maximum"] = meta.le
        elif isinstance(meta, annotated_types.MinLen):
            out["minItems" if array else "minLength"] = meta.min_length
        elif isinstance(meta, annotated_types.MaxLen):
            out["maxItems" if array else "maxLength"] = meta.max_length
        elif getattr(meta, "pattern", None):
            out["pattern"] = meta.pattern
    return out


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    else:
        value = info.default
    if value is PydanticUndefined or value is None:
        return None
    if isinstance(value, BaseModel):
        return {}  # the API server then applies the nested defaults
    if value == [] or value == {}:
        return None  # an empty default adds noise to every stored object
    return value


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Schema of a spec model: camelCase properties, required fields, defaults, CEL rules."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        kube = next((m for m in info.metadata if isinstance(m, KubeSchema)), None)
        schema = kube.schema() if kube else type_schema(info.annotation)
        schema.update(_constraints(info, array=schema.get("type") == "array"))
        default = _default(info)
        if default is not None:
            schema["default"] = default
        if info.description:
            schema["description"] = info.description
        if isinstance(info.json_schema_extra, dict):
            # a copy: a model used twice (prefill, decode) must not dump as a YAML alias
            schema.update(copy.deepcopy(info.json_schema_extra))  # type: ignore[arg-type]
        if info.is_required():
            required.append(key)
        properties[key] = schema
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if model.__doc__ and issubclass(model, SpecModel):
        out["description"] = " ".join(model.__doc__.split("\n\n")[0].split())
    if required:
        out["required"] = required
    rules = getattr(model, "rules", ())
    if rules:
        out["x-kubernetes-validations"] = [
            {"rule": r.cel, "message": r.message, **({"fieldPath": r.field} if r.field else {})}
            for r in rules
        ]
    return out


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": "An LLM served with prefill and decode in tandem, behind an OpenAI endpoint.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": model_schema(s.InferenceServiceSpec),
            "status": model_schema(InferenceServiceStatus),
        },
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                "rule": f"self.metadata.name.size() <= {NAME_MAX}",
                "message": f"metadata.name must be at most {NAME_MAX} characters (children's names add suffixes)",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        # helm keeps the CRD on uninstall: deleting it would delete every InferenceService.
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/part-of": "tandem"},
            "annotations": {"helm.sh/resource-policy": "keep"},
        },
        "spec": {
            "group": s.GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": s.PLURAL,
                "singular": s.SINGULAR,
                "kind": s.KIND,
                "listKind": f"{s.KIND}List",
                "shortNames": s.SHORT_NAMES,
                "categories": s.CATEGORIES,
            },
            "versions": [
                {
                    "name": s.VERSION,
                    "served": True,
                    "storage": True,
                    # `kubectl scale tisvc` scales the decode pool (in Aggregated mode the
                    # only pool): decode replicas bound concurrent streams.
                    "subresources": {"status": {}, "scale": SCALE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


HEADER = "# Generated by `python -m tandem.operator.crd` from operator/tandem/operator/spec/. Do not edit.\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
