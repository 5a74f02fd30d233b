"""``router: gateway``: the Gateway API Inference Extension objects (InferencePool, the
endpoint picker's Deployment, Service and RBAC, an HTTPRoute when asked), the engines taking
clients directly, the spec's rules, and the pool's acceptance in status."""

from __future__ import annotations

import pytest

from tandem.operator.crd import crd
from tandem.operator.render.manifests import render
from tandem.operator.status.children import Children, summarize_pool
from tandem.operator.status.compute import compute_status
from tandem.operator.topology import plan

from .utils import by_kind_name, isvc

GATEWAY = dict(router="gateway", proxy={"apiKeySecret": {"name": "keys"}})


def test_gateway_renders_a_pool_its_picker_and_no_proxy() -> None:
    objs = by_kind_name(render(isvc(**GATEWAY)))
    assert ("Deployment", "svc-proxy") not in objs and ("Service", "svc") not in objs
    pool = objs[("InferencePool", "svc")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {
            "matchLabels": {
                "tandem.dev/inferenceservice": "svc",
                "app.kubernetes.io/component": "engine",
            }
        },
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "svc-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    pod = objs[("Deployment", "svc-epp")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][:3] == ["epp", "--discovery", "kubernetes"]
    assert "--selector" in container["args"] and container["args"][-2:] == ["--port", "9002"]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert any(e["name"] == "TANDEM_INTERNAL_API_KEY" for e in container["env"])
    assert pod["serviceAccountName"] == "svc-epp"
    service = objs[("Service", "svc-epp")]["spec"]
    assert service["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    role = objs[("Role", "svc-epp")]
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"])
    assert ("HTTPRoute", "svc") not in objs


def test_behind_a_gateway_the_engines_take_clients_with_their_key() -> None:
    objs = by_kind_name(render(isvc(**GATEWAY)))
    env = objs[("Deployment", "svc-decode")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "TANDEM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}},
    } in env
    ingress = objs[("NetworkPolicy", "svc-engines")]["spec"]["ingress"]
    assert {"ports": [{"port": "http", "protocol": "TCP"}]} in ingress  # HTTP from the gateway
    proxied = by_kind_name(render(isvc(proxy={"apiKeySecret": {"name": "keys"}})))
    env = proxied[("Deployment", "svc-decode")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert all(e["name"] != "TANDEM_API_KEY" for e in env)  # behind the proxy: internal only
    assert len(proxied[("NetworkPolicy", "svc-engines")]["spec"]["ingress"]) == 2


def test_an_http_route_sends_the_gateways_traffic_to_the_pool() -> None:
    route = {"parentRefs": [{"name": "inference-gw", "namespace": "gw", "sectionName": "http"}]}
    objs = by_kind_name(
        render(isvc(**GATEWAY, gateway={"httpRoute": route, "failureMode": "FailOpen"}))
    )
    spec = objs[("HTTPRoute", "svc")]["spec"]
    assert spec["parentRefs"] == [
        {"name": "inference-gw", "namespace": "gw", "sectionName": "http"}
    ]
    assert spec["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "svc"}
    ]
    assert objs[("InferencePool", "svc")]["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"router": "gateway"}, "router gateway needs proxy.apiKeySecret"),
        (
            {"gateway": {"httpRoute": {"parentRefs": [{"name": "gw"}]}}},
            "gateway.httpRoute needs router gateway",
        ),
    ],
)
def test_the_gateway_rules(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        isvc(**spec)


def test_a_local_run_keeps_the_proxy() -> None:
    """``tandem up`` has no gateway: its front door stays the proxy."""
    topology = plan(isvc(**GATEWAY), discovery="static")
    assert topology.router == "proxy" and topology.role("proxy").args[0] == "proxy"


def _pool(parents: list[dict]) -> dict:
    return {"metadata": {"name": "svc"}, "status": {"parents": parents}}


def test_status_reports_the_pools_acceptance_by_its_gateways() -> None:
    service = isvc(**GATEWAY)
    topology = plan(service)

    def accepted(*pools: dict):
        kids = Children(pools=[summarize_pool(p) for p in pools])
        status = compute_status(service, topology, kids, 1, "2026-01-01T00:00:00Z")
        assert status.url is None  # the Gateway's address, not a proxy Service's
        return next(c for c in status.conditions if c.type == "InferencePoolAccepted")

    assert accepted().status == "Unknown" and accepted().reason == "NotCreated"
    assert accepted(_pool([])).reason == "NoGatewayReported"
    ok = {
        "parentRef": {"name": "gw"},
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"}],
    }
    assert accepted(_pool([ok])).status == "True"
    refused = {
        "parentRef": {"name": "other"},
        "conditions": [
            {
                "type": "Accepted",
                "status": "False",
                "reason": "NotAllowedByListeners",
                "message": "no",
            }
        ],
    }
    cond = accepted(_pool([ok, refused]))
    assert (cond.status, cond.reason) == ("False", "NotAllowedByListeners")
    assert "Gateway other" in cond.message
    proxied = compute_status(isvc(), plan(isvc()), Children(), 1, "2026-01-01T00:00:00Z")
    assert all(c.type != "InferencePoolAccepted" for c in proxied.conditions)


def test_router_is_immutable_in_the_crd() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = schema["properties"]["router"]["x-kubernetes-validations"]
    assert {"rule": "self == oldSelf", "message": "router is immutable"} in rules
