"""``router: gateway`` on the real control plane, with GIE's InferencePool CRD generated from
its published Go API types (``e2e/cluster/crdgen``): the operator, under the chart's RBAC,
renders the InferencePool and the endpoint picker, both become Ready (kwok pods), the pool is
what the API server's schema accepts, and deleting the InferenceService removes them."""

from __future__ import annotations

import pytest

from e2e.cluster import Cluster, wait_for
from e2e.utils import Operator, _apply, _children, _condition, _get, _isvc, _wait_ready

pytestmark = pytest.mark.usefixtures("third_party_crds")


def _pools(cluster: Cluster, namespace: str) -> list[dict]:
    return cluster.kubectl_json("get", "inferencepools", "-n", namespace)["items"]


def test_router_gateway_yields_a_ready_pool_and_picker_and_deleting_removes_them(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    cluster.kubectl(
        "create", "secret", "generic", "keys", "--from-literal=api-key=sk-e2e", "-n", namespace
    )
    name = "gw"
    _apply(
        cluster,
        _isvc(name, namespace, router="gateway", proxy={"apiKeySecret": {"name": "keys"}}),
    )
    isvc = _wait_ready(cluster, operator, namespace, name)
    pool = _get(cluster, "inferencepool", name, namespace)
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "gw-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert pool["spec"]["selector"]["matchLabels"]["tandem.dev/inferenceservice"] == name
    assert pool["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    picker = _get(cluster, "deployment", "gw-epp", namespace)
    assert picker["status"].get("readyReplicas") == 1
    assert _get(cluster, "service", "gw-epp", namespace)["spec"]["ports"][0]["port"] == 9002
    children = _children(cluster, namespace, name)
    assert "Deployment/gw-proxy" not in children and "Service/gw" not in children
    assert {"ServiceAccount/gw-epp", "Role/gw-epp", "RoleBinding/gw-epp"} <= set(children)
    # no Gateway routes to the pool here: the operator says so, and Ready does not wait for it
    accepted = _condition(isvc, "InferencePoolAccepted")
    assert (accepted["status"], accepted["reason"]) == ("Unknown", "NoGatewayReported")
    assert isvc["status"].get("url") is None

    immutable = _isvc(name, namespace, router="proxy", proxy={"apiKeySecret": {"name": "keys"}})
    result = _apply(cluster, immutable, False)
    assert result.returncode != 0 and "router is immutable" in result.stderr

    cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        "the pool and the picker to be collected",
        lambda: not _pools(cluster, namespace) and not _children(cluster, namespace, name),
        timeout=90,
        interval=1,
    )


def test_router_gateway_needs_the_clients_key_in_the_api_server(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    result = _apply(cluster, _isvc("nokey", namespace, router="gateway"), False)
    assert result.returncode != 0 and "router gateway needs proxy.apiKeySecret" in result.stderr
