"""Gang admission without an alpha API (issue 31, problem 5's second half): GPU engine pods
are created with a schedulingGate (GA since Kubernetes 1.30) that the operator removes only
when the whole service fits the free GPUs it sees; on by default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.cluster import Cluster, wait_for
from e2e.utils import (
    Operator,
    _apply,
    _condition,
    _filler,
    _get,
    _isvc,
    _wait_ready,
    running_operator,
)

GATE = "tandem.dev/gang-admission"


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, chart: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """The operator as installed by default: no PodGroup API, so admission gates are on."""
    yield from running_operator(
        Operator(cluster, tmp_path_factory.mktemp("operator"), "--no-gang-scheduling")
    )


def _engines(cluster: Cluster, namespace: str, name: str) -> list[dict]:
    selector = f"tandem.dev/inferenceservice={name},app.kubernetes.io/component=engine"
    return cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]


def test_a_service_is_admitted_only_when_it_fits_whole(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """4 GPUs free: the prefill pod (4) would fit, the decode pod (8) would not. Neither is
    admitted, so no GPU is held by a service that cannot serve, and the status says what is
    held and why; freeing GPUs admits both at once. A scale-up that does not fit is held
    the same way while the service keeps serving."""
    _apply(cluster, _filler(namespace, 3, gpus=4))  # 3 x 4 GPUs of 2 x 8: 4 free, on one node
    cluster.kubectl("rollout", "status", "deployment/filler", "-n", namespace, "--timeout=60s")
    name = "gang"
    spec = {"prefill": {"replicas": 1, "gpus": 4}, "decode": {"replicas": 1, "gpus": 8}}
    _apply(cluster, _isvc(name, namespace, **spec))

    def held() -> bool:
        cond = _condition(_get(cluster, "tisvc", name, namespace), "DecodeReady")
        return "gang admission holds 2 pod(s)" in cond.get("message", "")

    try:
        wait_for("the gang to be held", held, timeout=60)
    except TimeoutError:
        print(_get(cluster, "tisvc", name, namespace).get("status"), operator.tail())
        raise
    isvc = _get(cluster, "tisvc", name, namespace)
    assert _condition(isvc, "PrefillReady")["reason"] == "WaitingForGPUs"
    message = _condition(isvc, "Ready")["message"]
    assert "(prefill 4 + decode 8 nvidia.com/gpu)" in message and "(4)" in message
    pods = _engines(cluster, namespace, name)
    assert {p["metadata"]["labels"]["tandem.dev/role"] for p in pods} == {"prefill", "decode"}
    for pod in pods:  # gated: never reached the scheduler, hold no GPU
        assert [g["name"] for g in pod["spec"]["schedulingGates"]] == [GATE]
        assert not pod["spec"].get("nodeName")
    cluster.kubectl("scale", "deployment/filler", "-n", namespace, "--replicas=1")
    _wait_ready(cluster, operator, namespace, name, timeout=90)
    assert all(p["spec"].get("nodeName") for p in _engines(cluster, namespace, name))

    cluster.kubectl("scale", "tisvc", name, "-n", namespace, "--replicas=2")  # 8 more: 0 free

    def scale_up_held() -> bool:
        cond = _condition(_get(cluster, "tisvc", name, namespace), "DecodeReady")
        return "gang admission holds 1 pod(s) (decode 8" in cond.get("message", "")

    wait_for("the scale-up to be held", scale_up_held, timeout=60)
    assert _condition(_get(cluster, "tisvc", name, namespace), "Ready")["status"] == "True"
    cluster.kubectl("delete", "deployment", "filler", "-n", namespace)
    cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")
