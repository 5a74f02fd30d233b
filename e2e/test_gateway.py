"""``router: gateway`` on the real control plane, with GIE's InferencePool CRD generated from
its published Go API types (``e2e/cluster/crdgen``): the operator, under the chart's RBAC,
renders the InferencePool and the endpoint picker, both become Ready (kwok pods), the pool is
what the API server's schema accepts, and deleting the InferenceService removes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.cluster import Cluster, wait_for
from e2e.utils import (
    Operator,
    _account_kubeconfig,
    _apply,
    _children,
    _condition,
    _get,
    _isvc,
    _wait_ready,
)
from tandem.operator.render.manifests import render
from tandem.operator.spec.inference_service import load_inference_service
from tandem.operator.topology import plan
from tandem.server.net import free_port

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


def test_the_picker_follows_its_inference_pool_under_its_own_role(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """``tandem epp`` as the operator runs it (the rendered arguments, ``--pool-name``, and
    the picker's own ServiceAccount token: the rendered Role is all it may use) finds the
    engine pods through the InferencePool: at the pool's target port, at another once the
    pool is edited, none once it is deleted. The objects are the operator's ``render()``
    applied with kubectl (no operator running to undo the edit); kwok runs the pods."""
    cluster.kubectl(
        "create", "secret", "generic", "keys", "--from-literal=api-key=sk-e2e", "-n", namespace
    )
    body = _isvc("pool", namespace, router="gateway", proxy={"apiKeySecret": {"name": "keys"}})
    body["spec"]["decode"] = {"replicas": 2}
    service = load_inference_service(body)
    items = render(service)
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )
    pool = next(o for o in items if o["kind"] == "InferencePool")
    labels = pool["spec"]["selector"]["matchLabels"]  # the engines (1 prefill, 2 decode)
    selector = ",".join(f"{k}={v}" for k, v in labels.items())

    def pod_ips() -> list[str]:
        pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
        return [p["status"]["podIP"] for p in pods if (p.get("status") or {}).get("podIP")]

    wait_for("the engine pods' IPs", lambda: len(pod_ips()) == 3, timeout=90, interval=1)
    args = next(r for r in plan(service).roles if not r.is_engine).args
    assert args[args.index("--pool-name") + 1] == "pool"
    kubeconfig = _account_kubeconfig(cluster, namespace, "pool-epp", tmp_path / "epp.kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        env.pop(var, None)  # never in-cluster config here
    log = tmp_path / "epp.log"
    cmd = [sys.executable, "-m", "tandem.server.cli", *args, "--host", "127.0.0.1"]
    cmd += ["--port", str(free_port()), "--log-level", "info"]
    with log.open("wb") as out:
        picker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:

        def logged(line: str) -> Callable[[], bool]:
            def check() -> bool:
                assert picker.poll() is None, log.read_text()[-3000:]
                return all(line.format(ip) in log.read_text() for ip in pod_ips())

            return check

        wait_for("the pool's pods at its port", logged("node added: http://{}:8000"), 60)
        patch = {"spec": {"targetPorts": [{"number": 8100}]}}
        cluster.kubectl(
            "patch", "inferencepool", "pool", "-n", namespace, "--type=merge",
            "-p", json.dumps(patch),
        )  # fmt: skip
        wait_for("the pods at the edited port", logged("node added: http://{}:8100"), 60)
        cluster.kubectl("delete", "inferencepool", "pool", "-n", namespace)
        wait_for("no engines without the pool", logged("node removed: http://{}:8100"), 60)
    finally:
        picker.terminate()
        picker.wait(30)
