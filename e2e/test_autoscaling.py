"""Autoscaling on the real control plane, with KEDA's and the Prometheus Operator's CRDs.

The CRDs are generated from their published Go API types (``e2e/cluster/crdgen``) and
installed before the chart, so the API server validates every PodMonitor and ScaledObject we
create against the real schemas. Neither KEDA nor Prometheus runs here: the HPA controller
does (in kube-controller-manager), and a pool's activation from zero is played by
:func:`keda_activation`, which evaluates the ScaledObject's own activation trigger against the
real proxy's ``/metrics`` instead of a Prometheus query, and scales as KEDA would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from e2e.cluster import Cluster, wait_for
from e2e.pools import PlannerPools, PoolSpec
from e2e.utils import (
    RELEASE,
    RELEASE_NS,
    ROOT,
    Operator,
    _apply,
    _condition,
    _get,
    _isvc,
    running_operator,
)
from tandem.operator.autoscaler.metrics import queries
from tandem.operator.autoscaler.planner import PlannerState, config_for, decide
from tandem.operator.autoscaler.profile import PROFILE_KEY, EngineProfile
from tandem.operator.autoscaler.stabilization import PoolState
from tests.proxy.utils import PROXY_KEY, ProxyProcess, metric_value

pytestmark = pytest.mark.usefixtures("third_party_crds")


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, chart: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """The operator under the chart's RBAC, its planner loop off: the planner test drives
    the same round itself, in its own time."""
    yield from running_operator(
        Operator(cluster, tmp_path_factory.mktemp("operator"), "--no-planner")
    )


def test_chart_installs_a_pod_monitor_when_the_prometheus_operator_crds_exist(
    cluster: Cluster, chart: None
) -> None:
    pm = _get(cluster, "podmonitor", f"{RELEASE}-workloads", RELEASE_NS)
    spec = pm["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "tandem-operator"
    assert spec["podTargetLabels"] == ["tandem.dev/inferenceservice", "tandem.dev/role"]
    assert spec["podMetricsEndpoints"][0]["port"] == "http"
    # the operator's own metrics (controller_runtime_*), scraped from its metrics port
    operator = _get(cluster, "podmonitor", f"{RELEASE}-operator", RELEASE_NS)["spec"]
    assert operator["podMetricsEndpoints"][0]["port"] == "metrics"
    assert operator["selector"]["matchLabels"]["app.kubernetes.io/name"] == "tandem"


def test_new_autoscaling_rules_are_enforced_by_the_api_server(
    cluster: Cluster, chart: None, namespace: str
) -> None:
    cases = [
        (
            {"decode": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}},
            "minReplicas 0 needs backend KEDA or Planner",
        ),
        (
            {"decode": {"autoscaling": {"backend": "Planner", "maxReplicas": 2}}},
            "autoscaling backend Planner needs spec.slo",
        ),
    ]
    for i, (spec, message) in enumerate(cases):
        result = _apply(cluster, _isvc(f"bad{i}", namespace, **spec), False)
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_an_hpa_that_cannot_read_its_metric_is_reported_not_hidden(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """No custom metrics API is registered here: exactly the issue's silent failure."""
    auto = {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}}
    _apply(cluster, _isvc("hpa", namespace, mode="Aggregated", decode=auto))

    def reported() -> bool:
        cond = _condition(_get(cluster, "tisvc", "hpa", namespace), "AutoscalingActive")
        return cond.get("status") == "False" and "FailedGetPodsMetric" in cond.get("message", "")

    try:
        wait_for("AutoscalingActive=False FailedGetPodsMetric", reported, timeout=120, interval=2)
    except TimeoutError:
        print(_get(cluster, "hpa", "hpa-engine", namespace).get("status"))
        print(operator.tail())
        raise
    cond = _condition(_get(cluster, "tisvc", "hpa", namespace), "AutoscalingActive")
    assert cond["reason"] == "AutoscalingInactive"


def keda_activation(scaled_object: dict[str, Any], scrape: str) -> float | None:
    """KEDA's activation step with the proxy's own scrape as the metric source.

    Reads the metric that the ScaledObject's ``demand`` trigger queries (so a name the proxy
    does not export fails here) and returns its value when above ``activationThreshold``.
    """
    trigger = next(t for t in scaled_object["spec"]["triggers"] if t["name"] == "demand")
    query = trigger["metadata"]["query"]
    metric = re.search(r"increase\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{", query)
    assert metric is not None, query
    assert f"# TYPE {metric.group(1)} counter" in scrape, (
        f"the proxy does not export {metric.group(1)}"
    )
    value = metric_value(scrape, metric.group(1))
    return value if value > float(trigger["metadata"]["activationThreshold"]) else None


def test_scaled_object_pool_scales_from_zero_when_requests_reach_the_proxy(
    cluster: Cluster, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    name = "zero"
    decode = {"autoscaling": {"backend": "KEDA", "minReplicas": 0, "maxReplicas": 2}}
    _apply(cluster, _isvc(name, namespace, prefill={"replicas": 1}, decode=decode))
    wait_for(
        "the ScaledObject",
        lambda: (
            cluster.kubectl(
                "get", "scaledobject", f"{name}-decode", "-n", namespace, check=False
            ).returncode
            == 0
        ),
        timeout=60,
        interval=1,
    )
    so = _get(cluster, "scaledobject", f"{name}-decode", namespace)
    assert so["spec"]["scaleTargetRef"]["name"] == f"{name}-decode"
    assert so["spec"]["minReplicaCount"] == 0
    assert {t["name"] for t in so["spec"]["triggers"]} == {"queue", "demand"}
    assert so["metadata"]["ownerReferences"][0]["name"] == name
    # idle past the cooldown: KEDA scales the pool to zero
    cluster.kubectl("scale", f"deployment/{name}-decode", "-n", namespace, "--replicas=0")
    wait_for(
        "decode at zero",
        lambda: (
            (_get(cluster, "tisvc", name, namespace)["status"].get("decode") or {}).get("desired")
            == 0
        ),
        timeout=60,
        interval=1,
    )

    # a proxy with no decode engine behind it: requests get a clear 503 and are counted
    proxy = ProxyProcess(log_path=tmp_path / "proxy.log")
    try:
        proxy.wait_nodes(lambda nodes: not nodes)
        assert keda_activation(so, proxy.metrics()) is None  # no demand yet: stays at zero
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=PROXY_KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        assert exc.value.status_code == 503
        assert exc.value.response.headers["retry-after"].isdigit()
        demand = keda_activation(so, proxy.metrics())
    finally:
        proxy.stop()
    assert demand == 1

    # activation: KEDA takes the pool to one replica, the HPA it owns does the rest
    cluster.kubectl("scale", f"deployment/{name}-decode", "-n", namespace, "--replicas=1")

    def decode_ready() -> bool:
        status = _get(cluster, "tisvc", name, namespace)["status"].get("decode") or {}
        return status.get("ready") == 1

    wait_for("the decode pool back from zero", decode_ready, timeout=90, interval=1)
    # the operator's next apply leaves the autoscaler's replicas alone
    cluster.kubectl("annotate", "tisvc", name, "-n", namespace, "touch=1")
    assert _get(cluster, "deployment", f"{name}-decode", namespace)["spec"]["replicas"] == 1


def _samples(rate: float, isl: float = 1500, osl: float = 300) -> dict[str, float | None]:
    """What Prometheus would answer the planner at a steady ``rate``."""
    return {
        "rate": rate,
        "prompt_tokens": rate * isl,
        "output_tokens": rate * osl,
        "finished": rate,
        "backlog": 0.0,
        "trend": 0.0,
        "decode_backlog": 0.0,
        "ttft": None,
        "itl": None,
    }


def test_a_trace_through_the_planner_resizes_both_pools_on_the_cluster(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """Four planning rounds at given times and loads (no wall clock in the planner): the
    operator's round patches the scale, the Deployments' pods come and go on kwok nodes."""
    cm = next(yaml.safe_load_all((ROOT / "examples/slo-planner.yaml").read_text()))
    profile = EngineProfile.from_dict(json.loads(cm["data"][PROFILE_KEY]))
    pools = PlannerPools(cluster, namespace, "planned", PoolSpec(600, 25, profile, 5, 4))
    try:
        pools.wait_for_pools()
        assert pools.ready() == (1, 1)  # a fresh Deployment's one replica
        cfg = config_for(pools.isvc, profile)
        expected = PlannerState(PoolState(1), PoolState(1))
        seen = []
        # quiet, a surge, the surge gone (the window still holds it), a window later
        for now, rate in ((0.0, 1.0), (15.0, 12.0), (30.0, 0.5), (400.0, 0.5)):
            decision = pools.round(now, _samples(rate))
            want = decide(expected, now, _samples(rate), cfg, (0, 0))
            expected = want.state
            assert (decision.prefill, decision.decode) == (want.prefill, want.decode)
            assert pools.desired() == (want.prefill, want.decode)
            seen.append(pools.settle())
            assert seen[-1] == (want.prefill, want.decode), pools.desired()
        quiet, surge, held, later = seen
        assert surge[0] > quiet[0] and surge[1] > quiet[1]  # both pools grew, P:D by the SLO
        assert held == surge  # scale-down waits for the stabilisation window
        assert later == (1, 1) and later != surge
        # every query the planner needs was asked, by these rounds only (--no-planner)
        assert sorted(pools.source.asked) == sorted(4 * list(queries(namespace, "planned")))
    finally:
        pools.stop()
