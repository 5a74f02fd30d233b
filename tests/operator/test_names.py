"""Every name the API server accepts for an InferenceService (a DNS-1123 subdomain of at most
40 characters, the CRD's limit) gets children whose names Kubernetes accepts: DNS-1035
labels for Services, at most 63 characters (a Job's name becomes a label value)."""

from __future__ import annotations

import re

import pytest

from tandem.operator.render.manifests import render
from tandem.operator.render.meta import child_base, service_url
from tandem.operator.render.options import RenderOptions
from tandem.operator.spec.inference_service import NAME_MAX, load_inference_service
from tandem.operator.topology import plan

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# Names the API server accepts (DNS-1123 subdomains) within the CRD's 40 characters.
ACCEPTED = [
    "qwen",
    "1model",
    "a.b",
    "a.b.c",
    "9",
    "0-0",
    "model.v1-2",
    "a" * NAME_MAX,
    "1" + "2" * (NAME_MAX - 1),
    "x." * (NAME_MAX // 2 - 1) + "yz",
]


def _isvc(name: str, model_uri: str = "/models/tiny", **spec):
    return load_inference_service(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ml", "uid": "u1", "generation": 1},
            "spec": {"model": {"name": "tiny", "uri": model_uri}, **spec},
        }
    )


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_accepted_name_gets_valid_child_names(name: str) -> None:
    base = child_base(name)
    assert DNS_1035.match(base) and len(base) <= NAME_MAX
    if DNS_1035.match(name):
        assert base == name  # valid names keep their children's names
    for spec in ({}, {"mode": "Aggregated"}):
        service = _isvc(name, **spec)
        options = RenderOptions(model_ready=True, gang_scheduling=True)
        for obj in render(service, options, plan(service)):
            child = obj["metadata"]["name"]
            assert DNS_1123_LABEL.match(child) and len(child) <= 63, (obj["kind"], child)
            if obj["kind"] == "Service":
                assert DNS_1035.match(child), child
            for value in obj["metadata"]["labels"].values():
                assert LABEL_VALUE.match(value) and len(value) <= 63, value
        assert service_url(service).startswith(f"http://{base}.ml.svc.cluster.local:")
    hf = _isvc(name, model_uri="hf://org/repo", mode="Aggregated")
    for obj in render(hf, RenderOptions(), plan(hf)):
        child = obj["metadata"]["name"]
        assert DNS_1123_LABEL.match(child) and len(child) <= 63, (obj["kind"], child)


def test_derived_names_are_stable_and_never_shared() -> None:
    assert child_base("a.b") == child_base("a.b")
    bases = {child_base(n) for n in ["a.b", "a-b", "a.b.c", "a-b-c", "a.b-c", "1model", "x1model"]}
    assert len(bases) == 7


@pytest.mark.parametrize("name", ["a" * (NAME_MAX + 1), "Upper", "-a", "a-", "a..b", "a_b"])
def test_names_beyond_the_crd_are_refused_with_the_field(name: str) -> None:
    with pytest.raises(ValueError, match="metadata.name"):
        _isvc(name)
