"""The InferenceService spec: defaults, every rule rejects what it should with its message,
and the CRD in crds/ and in the Helm chart is exactly what the spec package generates."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.operator import crd as crd_module
from tandem.operator.spec.engine import EngineSpec
from tandem.operator.spec.inference_service import InferenceServiceSpec, load_inference_service
from tandem.operator.spec.roles import RoleSpec
from tandem.operator.topology import NON_ENGINE_FIELDS

ROOT = Path(__file__).resolve().parents[2]


def isvc(**spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "tiny", "uri": "/models/tiny"}, **spec}
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ml"},
        "spec": body,
    }


def test_defaults_fill_a_minimal_spec() -> None:
    got = load_inference_service(isvc())
    assert got.spec.mode == "Disaggregated"
    assert got.spec.decode.gpus == 1 and got.spec.decode.desired_replicas() == 1
    assert got.spec.prefill is None  # the plan gives Disaggregated mode a default prefill pool
    assert got.spec.proxy.service.port == 8000 and got.spec.proxy.replicas == 1
    assert got.spec.engine.block_size is None  # unset engine fields keep the engine's defaults


def test_yaml_text_and_camel_case_are_accepted() -> None:
    text = yaml.safe_dump(
        isvc(
            engine={"maxModelLen": 4096, "gpuMemoryUtilization": 0.8},
            prefill={"replicas": 3, "gpus": 2},
        )
    )
    got = load_inference_service(text)
    assert got.spec.engine.max_model_len == 4096 and got.spec.engine.gpu_memory_utilization == 0.8
    assert got.spec.prefill is not None and got.spec.prefill.replicas == 3


BAD = [
    (
        {"mode": "Aggregated", "prefill": {"replicas": 1}},
        "spec",
        "Aggregated mode has no prefill role",
    ),
    (
        {"decode": {"replicas": 2, "autoscaling": {"maxReplicas": 3}}},
        "spec.decode",
        "replicas and autoscaling are mutually exclusive",
    ),
    (
        {"decode": {"autoscaling": {"minReplicas": 4, "maxReplicas": 3}}},
        "spec.decode.autoscaling",
        "autoscaling.minReplicas must not exceed maxReplicas",
    ),
    (
        {"prefill": {"gpus": 2, "tensorParallelSize": 4}},
        "spec.prefill",
        "tensorParallelSize must equal gpus",
    ),
    (
        {"decode": {"gpus": 2, "resources": {"limits": {"nvidia.com/gpu": "1"}}}},
        "spec.decode",
        "resources.limits['nvidia.com/gpu'] must equal gpus",
    ),
    ({"engine": {"blockSize": 24}}, "spec.engine", "engine.blockSize must be a power of two"),
    (
        {"model": {"name": "m", "uri": "s3://bucket/model"}},
        "spec.model",
        "model.uri must be hf://org/repo",
    ),
    (
        {"model": {"name": "m", "uri": "/m", "revision": "main"}},
        "spec.model",
        "apply only to hf:// models",
    ),
    ({"engine": {"maxModelLen": 0}}, "spec.engine.maxModelLen", "greater than or equal to 1"),
    (
        {"engine": {"blockSize": 16, "typo": 1}},
        "spec.engine.typo",
        "Extra inputs are not permitted",
    ),
    ({"mode": "Both"}, "spec.mode", "'Disaggregated' or 'Aggregated'"),
]


@pytest.mark.parametrize(("spec", "where", "message"), BAD, ids=[b[2][:40] for b in BAD])
def test_bad_specs_are_rejected_naming_the_field(
    spec: dict[str, Any], where: str, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        load_inference_service(isvc(**spec))
    text = str(err.value)
    assert message in text
    assert f"{where}: " in text


def test_not_a_mapping_and_bad_yaml_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="mapping"):
        load_inference_service("- a list")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_inference_service("a: [")
    with pytest.raises(ValueError, match="metadata.name"):
        load_inference_service({**isvc(), "metadata": {"name": "Has_Caps"}})


def test_every_rule_has_a_cel_twin_in_the_crd() -> None:
    """Each Python rule is emitted as a CEL rule with the same message, at the same place."""
    schema = crd_module.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_schema = schema["properties"]["spec"]
    places = {
        InferenceServiceSpec: spec_schema,
        EngineSpec: spec_schema["properties"]["engine"],
        RoleSpec: spec_schema["properties"]["decode"],
    }
    for model, where in places.items():
        cel = {r["message"]: r["rule"] for r in where["x-kubernetes-validations"]}
        for rule in model.rules:
            assert cel[rule.message] == rule.cel
    assert (
        spec_schema["properties"]["prefill"]["x-kubernetes-validations"]
        == spec_schema["properties"]["decode"]["x-kubernetes-validations"]
    )
    mode = spec_schema["properties"]["mode"]
    assert {"rule": "self == oldSelf", "message": "mode is immutable"} in mode[
        "x-kubernetes-validations"
    ]


def _assert_structural(schema: dict[str, Any], path: str = "") -> None:
    """Every node has a type (or preserves unknown fields); no $ref, anyOf or nullable tricks."""
    assert "$ref" not in schema and "anyOf" not in schema, path
    assert (
        "type" in schema
        or schema.get("x-kubernetes-preserve-unknown-fields")
        or schema.get("x-kubernetes-int-or-string")  # Kubernetes' IntOrString, structural
    ), path
    for key, sub in (schema.get("properties") or {}).items():
        _assert_structural(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        _assert_structural(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        _assert_structural(schema["additionalProperties"], f"{path}{{}}")


def test_crd_is_structural_with_status_subresource_and_printer_columns() -> None:
    crd = crd_module.crd()
    names = crd["spec"]["names"]
    assert (crd["metadata"]["name"], names["shortNames"], names["categories"]) == (
        "inferenceservices.tandem.dev",
        ["tisvc"],
        ["tandem"],
    )
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.decode.replicas",
            "statusReplicasPath": ".status.decode.ready",
            "labelSelectorPath": ".status.decodeSelector",
        },
    }
    _assert_structural(version["schema"]["openAPIV3Schema"])
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Model",
        "Mode",
        "Prefill",
        "Decode",
        "Ready",
        "Reason",
        "Phase",
        "URL",
        "Age",
    ]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["mode"]["default"] == "Disaggregated"
    assert spec["properties"]["decode"]["default"] == {}
    assert spec["required"] == ["model"]


def test_crd_file_and_helm_template_equal_the_generated_crd() -> None:
    generated = crd_module.crd_yaml()
    assert (ROOT / "crds" / crd_module.CRD_FILE).read_text() == generated, (
        "regenerate: python -m tandem.operator.crd > crds/" + crd_module.CRD_FILE
    )
    assert (ROOT / "helm/tandem/templates/crd-inferenceservices.yaml").read_text() == generated, (
        "regenerate: python -m tandem.operator.crd > helm/tandem/templates/crd-inferenceservices.yaml"
    )


def test_engine_fields_are_engine_config_fields() -> None:
    """spec.engine's names are EngineConfig's, with compatible types, so topology.py can map them
    onto the flags generically; and every EngineConfig field a user should set is exposed."""
    from tandem.server.engine.config import EngineConfig

    config_hints = typing.get_type_hints(EngineConfig)
    config_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for name, info in EngineSpec.model_fields.items():
        if name in NON_ENGINE_FIELDS:
            continue
        assert name in config_fields, name
        spec_args = {a for a in typing.get_args(info.annotation) if a is not type(None)}
        want = config_hints[name]
        want_args = {a for a in typing.get_args(want) if a is not type(None)} or {want}
        if typing.get_origin(want) is typing.Literal:
            assert spec_args == {typing.Literal[typing.get_args(want)]} or set(
                typing.get_args(next(iter(spec_args)))
            ) == set(typing.get_args(want)), name
        else:
            assert spec_args <= want_args, name
    # Not exposed on purpose: the model comes from spec.model, the device is the pod's GPUs,
    # tensor parallelism is each role's gpus, and the CPU-only KV byte cap is irrelevant; the
    # LoRA config file is the operator's own ConfigMap of spec.loras (topology.lora_config);
    # a multi-node replica's group (nnodes, node_rank, leader_addr) is each role's
    # nodesPerReplica, rendered with LWS's addresses (render/leader_worker_set.py).
    hidden = {"model", "device", "tensor_parallel_size", "max_kv_cache_bytes", "lora_config"}
    hidden |= {"nnodes", "node_rank", "leader_addr"}
    assert config_fields - set(EngineSpec.model_fields) == hidden
