"""Issue 31, the operator on day two, on the real control plane: each of its problems 1-5
reproduced as a platform engineer meets it, and shown fixed.

kwok runs no containers, so what the kubelet would say (image pulls, crash loops) is unit
tested from pod statuses (tests/operator/test_status.py); what the API server, the
scheduler and the controllers say (names, quotas, admission, PriorityClasses, rollouts,
autoscalers) is tested here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster, wait_for
from e2e.utils import (
    RELEASE,
    RELEASE_NS,
    ROOT,
    Operator,
    Watch,
    _apply,
    _condition,
    _events,
    _filler,
    _get,
    _isvc,
    _patch_engine,
    _quota,
    _wait_condition,
    _wait_ready,
    running_operator,
)


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, chart: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """The operator under the chart's RBAC, serving its own metrics on a free port, with
    neither gang admission (so the new prefill starts while the new decode cannot)."""
    yield from running_operator(
        Operator(
            cluster,
            tmp_path_factory.mktemp("operator"),
            "--metrics-address",
            "127.0.0.1:0",
            # the hold is tested alone here (gang admission's own test is test_gang_admission)
            "--no-gang-scheduling",
            "--no-admission-gates",
        )
    )


# ---- problem 1: names the API server accepts ------------------------------------------------


def test_every_name_the_api_server_accepts_is_served_or_refused_at_apply(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """`1model` and `a.b` pass the API server: each gets children named as DNS-1035 labels
    and goes Ready; a name past the CRD's limit, or not a DNS-1123 subdomain, is refused by
    `kubectl apply` with the reason."""
    accepted = ["1model", "a.b", "n" * 40]
    for name in accepted:
        _apply(cluster, _isvc(name, namespace, mode="Aggregated"))
    for name in accepted:
        isvc = _wait_ready(cluster, operator, namespace, name)
        host = isvc["status"]["url"].removeprefix("http://").split(".", 1)[0]
        service = _get(cluster, "service", host, namespace)  # the endpoint's Service exists
        assert service["metadata"]["labels"]["tandem.dev/inferenceservice"] == name
    refused = {
        "n" * 41: "metadata.name must be at most 40 characters",
        "Upper": "a lowercase RFC 1123 subdomain",
        "a_b": "a lowercase RFC 1123 subdomain",
    }
    for name, message in refused.items():
        result = _apply(cluster, _isvc(name, namespace, mode="Aggregated"), False)
        assert result.returncode != 0 and message in result.stderr, result.stderr
    for name in accepted:
        cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")


# ---- problem 2: refused pods are not a normal rollout ---------------------------------------


def test_pods_the_api_server_refuses_are_degraded_within_seconds_with_its_words(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """A GPU ResourceQuota of 0 and a missing PriorityClass: the Deployment says
    ReplicaFailure=True FailedCreate at once; so does the InferenceService, each with a
    reason of its own, the API server's message, and one Warning Event per cause (not 3),
    long before the 2,100 s progress deadline."""
    _apply(cluster, _quota(namespace, "gpus", {"requests.nvidia.com/gpu": "0"}))
    _apply(cluster, _isvc("quota", namespace, mode="Aggregated", decode={"gpus": 1}))
    isvc = _wait_condition(cluster, operator, namespace, "quota", "Ready", "QuotaExceeded")
    assert _condition(isvc, "Degraded")["reason"] == "QuotaExceeded"
    assert _condition(isvc, "DecodeReady")["reason"] == "QuotaExceeded"
    assert _condition(isvc, "Progressing")["status"] == "False"
    assert "exceeded quota: gpus" in _condition(isvc, "Ready")["message"]
    assert isvc["status"]["phase"] == "Degraded"

    missing = {"replicas": 1, "priorityClassName": "does-not-exist"}
    _apply(cluster, _isvc("priority", namespace, mode="Aggregated", decode=missing))
    isvc = _wait_condition(
        cluster, operator, namespace, "priority", "Ready", "PriorityClassNotFound"
    )
    assert "no PriorityClass with name does-not-exist" in _condition(isvc, "Ready")["message"]
    for name, reason in (("quota", "QuotaExceeded"), ("priority", "PriorityClassNotFound")):
        wait_for(
            f"the {reason} Event",
            lambda n=name, r=reason: _events(cluster, namespace, n, r),
            timeout=30,
        )
        warnings = [e for e in _events(cluster, namespace, name) if e["type"] == "Warning"]
        assert [e["reason"] for e in warnings] == [reason], warnings
    for name in ("quota", "priority"):
        cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")


# ---- problem 3: autoscaling status tells the truth ------------------------------------------


KEDA_ZERO = {"autoscaling": {"backend": "KEDA", "minReplicas": 0, "maxReplicas": 2}}


@pytest.mark.usefixtures("third_party_crds")
def test_keda_without_its_controller_is_not_active_and_scale_to_zero_is_idle(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """The ScaledObject CRD is installed but no KEDA controller runs: AutoscalingActive is
    Unknown NotReported (not True "the autoscalers can read metrics"). When KEDA scales the
    pool to zero (done here as KEDA does: the ScaledObject Ready, the Deployment's scale at
    0), the service is Idle: Ready=False Idle, Degraded=False, no Warning Event."""
    name = "zero"
    _apply(cluster, _isvc(name, namespace, mode="Aggregated", decode=KEDA_ZERO))
    isvc = _wait_ready(cluster, operator, namespace, name)
    isvc = _wait_condition(cluster, operator, namespace, name, "AutoscalingActive", "NotReported")
    assert _condition(isvc, "AutoscalingActive")["status"] == "Unknown"
    assert "KEDA's operator has not reported" in _condition(isvc, "AutoscalingActive")["message"]
    keda_status = {
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ok"},
                {"type": "Active", "status": "False", "reason": "ScalerNotActive", "message": ""},
            ]
        }
    }
    cluster.kubectl(
        "patch",
        "scaledobject",
        f"{name}-engine",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(keda_status),
    )
    cluster.kubectl("scale", "deployment", f"{name}-engine", "-n", namespace, "--replicas=0")
    isvc = _wait_condition(cluster, operator, namespace, name, "Ready", "Idle")
    assert isvc["status"]["phase"] == "Idle"
    assert _condition(isvc, "Degraded")["status"] == "False"
    assert _condition(isvc, "AutoscalingActive")["status"] == "True"
    assert "inactive (no demand)" in _condition(isvc, "AutoscalingActive")["message"]
    items = _events(cluster, namespace, name)
    assert not [e for e in items if e["type"] == "Warning"], items
    assert sorted(e["reason"] for e in items) == ["AllRolesReady", "Idle"]
    cluster.kubectl("scale", "deployment", f"{name}-engine", "-n", namespace, "--replicas=1")
    _wait_ready(cluster, operator, namespace, name)  # the first request's wake-up
    cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")


def test_a_planner_that_cannot_reach_prometheus_is_a_condition(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """The SLO planner's 15 s loop failing (here: nothing listens at its Prometheus address)
    is AutoscalingActive=False PlannerFailing with the error, not only a log line."""
    profile = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "profile", "namespace": namespace},
        "data": {"profile.json": json.dumps(_profile())},
    }
    _apply(cluster, profile)
    auto = {
        "backend": "Planner",
        "minReplicas": 1,
        "maxReplicas": 2,
        "prometheusAddress": "http://127.0.0.1:9",
    }
    slo = {"ttftMs": 500, "itlMs": 50, "profileConfigMap": "profile"}
    body = _isvc(
        "planned", namespace, prefill={"autoscaling": auto}, decode={"autoscaling": auto}, slo=slo
    )
    _apply(cluster, body)
    _wait_ready(cluster, operator, namespace, "planned")
    isvc = _wait_condition(
        cluster, operator, namespace, "planned", "AutoscalingActive", "PlannerFailing"
    )
    assert "Connection refused" in _condition(isvc, "AutoscalingActive")["message"]
    assert _condition(isvc, "Degraded")["reason"] == "PlannerFailing"
    assert _condition(isvc, "Ready")["status"] == "True"  # it serves; it cannot scale
    cluster.kubectl("delete", "tisvc", "planned", "-n", namespace, "--wait=true", "--timeout=60s")


def _profile() -> dict[str, Any]:
    """A measured engine's shape (any valid one: the round fails before it is used)."""
    return {
        "prefillIsl": [128, 2048],
        "prefillTokensPerSecond": [4000.0, 8000.0],
        "decodeBatch": [1, 32],
        "decodeContext": [128, 4096],
        "decodeStepSeconds": [[0.01, 0.02], [0.03, 0.05]],
        "kvCacheTokens": 100000,
        "maxNumSeqs": 64,
    }


# ---- problem 4: Ready means "a serving path exists" -----------------------------------------


def _settled(cluster: Cluster, namespace: str, name: str, generation: int) -> bool:
    isvc = _get(cluster, "tisvc", name, namespace)
    return (
        isvc["status"].get("observedGeneration") == generation
        and _condition(isvc, "RolloutComplete").get("status") == "True"
    )


def test_ready_stays_true_through_a_scale_up_and_a_rollout(
    cluster: Cluster, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    """`kubectl scale tisvc` and a model-settings patch roll pods; every version of the
    InferenceService the API server sent meanwhile says Ready=True (kubectl wait, GitOps
    health checks and alerts see a serving service), while RolloutComplete tracks the roll."""
    name = "steady"
    _apply(cluster, _isvc(name, namespace, prefill={"replicas": 1}, decode={"replicas": 2}))
    _wait_ready(cluster, operator, namespace, name)
    with Watch(cluster, tmp_path / "watch.json", "tisvc", name, "-n", namespace) as watch:
        cluster.kubectl("scale", "tisvc", name, "-n", namespace, "--replicas=4")
        wait_for("the scale-up", lambda: _settled(cluster, namespace, name, 2), timeout=90)
        _patch_engine(cluster, namespace, name, {"maxModelLen": 4096}, generation=3)
        wait_for("the rollout", lambda: _settled(cluster, namespace, name, 3), timeout=90)
        wait_for("the watch to catch up", lambda: len(watch.events()) > 2, timeout=30)
    versions = [e["object"] for e in watch.events()]
    ready = [
        (_condition(v, "Ready").get("status"), _condition(v, "Ready").get("message"))
        for v in versions
    ]
    assert {r[0] for r in ready} == {"True"}, [r for r in ready if r[0] != "True"]
    rollout = [_condition(v, "RolloutComplete").get("status") for v in versions]
    assert "False" in rollout and rollout[-1] == "True"
    assert versions[-1]["status"]["decode"]["replicas"] == "4/4"
    assert len(_events(cluster, namespace, name, "AllRolesReady")) == 1
    cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")


# ---- problem 5: P/D-safe rollouts -----------------------------------------------------------


def _pairs_at_each_event(events: list[dict[str, Any]]) -> list[set[str]]:
    """After each pod event, the KV layouts that have a ready prefill and a ready decode pod."""
    pods: dict[str, dict[str, Any]] = {}
    out = []
    for event in events:
        pod = event["object"]
        if event["type"] == "DELETED":
            pods.pop(pod["metadata"]["name"], None)
        else:
            pods[pod["metadata"]["name"]] = pod
        ready: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        for p in pods.values():
            conditions = {c["type"]: c["status"] for c in p["status"].get("conditions") or []}
            if conditions.get("Ready") == "True" and not p["metadata"].get("deletionTimestamp"):
                labels = p["metadata"]["labels"]
                ready[labels["tandem.dev/role"]].add(labels["tandem.dev/kv-layout"])
        out.append(ready["prefill"] & ready["decode"])
    return out


def test_a_kv_layout_rollout_keeps_a_same_layout_pair_at_every_pod_event(
    cluster: Cluster, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    """The issue's broken roll, made slow where it hurts: one GPU is free, so the new
    prefill (1 GPU) starts and turns Ready at once while the new decode (4 GPUs) cannot be
    placed. Two Deployments rolling alone retire the old prefill right then, leaving no
    same-layout pair for as long as the new decode takes. Here the old engines are held
    until a new pair is Ready; a pod watch checks a same-layout ready pair after every
    event, from before the patch to the end of the roll."""
    name = "pd"
    total = cluster.nodes.gpus * cluster.nodes.count
    spec = {"prefill": {"replicas": 1, "gpus": 1}, "decode": {"replicas": 1, "gpus": 4}}
    _apply(cluster, _isvc(name, namespace, **spec))
    _wait_ready(cluster, operator, namespace, name)
    _apply(cluster, _filler(namespace, total - 5 - 1))  # one GPU left free
    cluster.kubectl("rollout", "status", "deployment/filler", "-n", namespace, "--timeout=60s")
    selector = f"tandem.dev/inferenceservice={name},app.kubernetes.io/component=engine"
    args = ("pods", "-n", namespace, "-l", selector)
    with Watch(cluster, tmp_path / "pods.json", *args) as watch:
        old = {p["metadata"]["name"] for p in cluster.kubectl_json("get", *args)["items"]}
        _patch_engine(cluster, namespace, name, {"blockSize": 32}, generation=2)
        layout = _get(cluster, "deployment", f"{name}-prefill", namespace)["spec"]["template"][
            "metadata"
        ]["labels"]["tandem.dev/kv-layout"]

        def new_prefill_ready() -> bool:
            pods = cluster.kubectl_json("get", *args)["items"]
            return any(
                p["metadata"]["labels"]["tandem.dev/kv-layout"] == layout
                and p["metadata"]["labels"]["tandem.dev/role"] == "prefill"
                and any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions") or []
                )
                for p in pods
            )

        wait_for("the new prefill to be Ready", new_prefill_ready, timeout=60)
        # the new decode cannot be placed; the old prefill is held, not retired
        pods = {p["metadata"]["name"]: p for p in cluster.kubectl_json("get", *args)["items"]}
        assert old <= set(pods) and not any(
            pods[n]["metadata"].get("deletionTimestamp") for n in old
        )
        deployment = _get(cluster, "deployment", f"{name}-prefill", namespace)["spec"]
        assert deployment["minReadySeconds"] == deployment["progressDeadlineSeconds"] - 1
        isvc = _get(cluster, "tisvc", name, namespace)
        assert _condition(isvc, "Ready")["status"] == "True"
        assert _condition(isvc, "DecodeReady")["reason"] == "WaitingForGPUs"
        cluster.kubectl("scale", "deployment/filler", "-n", namespace, "--replicas=0")
        wait_for("the roll to finish", lambda: _settled(cluster, namespace, name, 2), timeout=120)

        def only_new_layout() -> bool:
            pods = cluster.kubectl_json("get", *args)["items"]
            return {p["metadata"]["labels"]["tandem.dev/kv-layout"] for p in pods} == {layout}

        wait_for("the old engines to go", only_new_layout, timeout=120)
        wait_for(
            "the watch to see the old pods go",
            lambda: sum(e["type"] == "DELETED" for e in watch.events()) >= 2,
            timeout=60,
        )
    pairs = _pairs_at_each_event(watch.events())
    first = next(i for i, p in enumerate(pairs) if p)  # the initial list reaches the old pair
    assert first <= 1 and all(pairs[first:]), pairs
    assert pairs[-1] == {layout}
    assert "minReadySeconds" not in _get(cluster, "deployment", f"{name}-decode", namespace)["spec"]
    cluster.kubectl("delete", "deployment", "filler", "-n", namespace)
    cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")


# ---- the operator's own metrics; helm uninstall cannot strand services ----------------------


def _scrape(op: Operator) -> dict[str, float]:
    port = re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", op.output_since_start())
    text = urllib.request.urlopen(f"http://127.0.0.1:{port[-1]}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            samples[series] = float(value)
    return samples


def _check_uninstall(op: Operator, namespace: str) -> subprocess.CompletedProcess[str]:
    """The chart's pre-delete hook's command, under the chart's ServiceAccount (kwok runs no
    containers, so the hook's Job would pass there without running it)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.server.cli",
            "operator",
            "--check-uninstall",
            "--kubeconfig",
            str(op.kubeconfig),
            "--namespace",  # this test's: other modules' namespaces may still be going
            namespace,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


def test_operator_metrics_and_an_uninstall_that_would_strand_services_is_refused(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """controller-runtime's metric names count this operator's reconciles, errors and
    durations; the chart's pre-delete hook refuses `helm uninstall` while an
    InferenceService exists (it would hang on the operator's finalizer) and passes after."""
    name = "metered"
    _apply(cluster, _isvc(name, namespace, mode="Aggregated"))
    _wait_ready(cluster, operator, namespace, name)
    samples = _scrape(operator)
    ok = 'controller_runtime_reconcile_total{controller="inferenceservice",result="success"}'
    assert samples[ok] >= 1
    assert 'controller_runtime_reconcile_errors_total{controller="inferenceservice"}' in samples
    count = 'controller_runtime_reconcile_time_seconds_count{controller="inferenceservice"}'
    assert samples[count] >= samples[ok]
    assert 'workqueue_depth{name="inferenceservice"}' in samples
    assert samples['tandem_operator_events_total{reason="AllRolesReady",type="Normal"}'] >= 1

    hooks = cluster.helm("get", "hooks", RELEASE, "-n", RELEASE_NS).stdout
    assert "helm.sh/hook: pre-delete" in hooks and "--check-uninstall" in hooks
    refused = _check_uninstall(operator, namespace)
    assert refused.returncode == 1, refused
    assert f"{namespace}/{name}" in refused.stderr and "Delete them first" in refused.stderr
    cluster.kubectl("delete", "tisvc", name, "-n", namespace, "--wait=true", "--timeout=60s")
    assert _check_uninstall(operator, namespace).returncode == 0
