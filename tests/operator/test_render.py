"""render(): the Kubernetes objects for both modes, and status from children."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.operator.cli import add_arguments, run
from tandem.operator.render.manifests import render
from tandem.operator.render.options import RenderOptions
from tandem.operator.render.security import internal_credential_secret
from tandem.operator.spec.inference_service import load_inference_service
from tandem.operator.status.children import Children, DeploymentSummary, JobSummary, PodSummary
from tandem.operator.status.compute import as_patch, compute_status
from tandem.operator.topology import plan

from .utils import UID, by_kind_name, isvc

ROOT = Path(__file__).resolve().parents[2]


def test_disaggregated_renders_each_role_with_its_service_and_pdb() -> None:
    objs = by_kind_name(render(isvc(prefill={"replicas": 2, "gpus": 2}, decode={"replicas": 3})))
    assert set(objs) == {
        ("NetworkPolicy", "svc-engines"),
        ("Deployment", "svc-prefill"),
        ("Service", "svc-prefill"),
        ("PodDisruptionBudget", "svc-prefill"),
        ("Deployment", "svc-decode"),
        ("Service", "svc-decode"),
        ("PodDisruptionBudget", "svc-decode"),
        ("Deployment", "svc-proxy"),
        ("Service", "svc"),
        ("PodDisruptionBudget", "svc-proxy"),
        ("ServiceAccount", "svc-proxy"),
        ("Role", "svc-proxy"),
        ("RoleBinding", "svc-proxy"),
    }
    for obj in objs.values():
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "tandem.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "svc",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        labels = obj["metadata"]["labels"]
        assert (
            labels["app.kubernetes.io/instance"] == "svc"
            and labels["tandem.dev/inferenceservice"] == "svc"
        )
        assert labels["app.kubernetes.io/managed-by"] == "tandem-operator"
    prefill = objs[("Deployment", "svc-prefill")]
    assert prefill["spec"]["replicas"] == 2
    assert prefill["spec"]["selector"]["matchLabels"] == {
        "tandem.dev/inferenceservice": "svc",
        "tandem.dev/role": "prefill",
    }
    assert prefill["spec"]["template"]["metadata"]["labels"]["tandem.dev/role"] == "prefill"
    assert objs[("Service", "svc-prefill")]["spec"]["clusterIP"] == "None"  # headless


def test_engine_pods_get_gpus_probes_and_a_drain() -> None:
    objs = by_kind_name(
        render(
            isvc(
                decode={"gpus": 4, "resources": {"requests": {"cpu": "8"}}},
                engine={"shutdownTimeoutSeconds": 120, "startupTimeoutSeconds": 3600},
            )
        )
    )
    pod = objs[("Deployment", "svc-decode")]["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # the given cpu request wins over the default; memory keeps the default (not BestEffort)
    assert engine["resources"]["requests"] == {"cpu": "8", "memory": "8Gi", "nvidia.com/gpu": "4"}
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[-4:] == ["--host", "0.0.0.0", "--port", "8000"]
    startup = engine["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert (
        startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    )  # a slow load is not a crash
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in engine["livenessProbe"]  # /health is 503 while draining or asleep
    assert engine["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert (
        pod["terminationGracePeriodSeconds"]
        > 120 + engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    )
    assert args[args.index("--shutdown-timeout") + 1] == "120"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_aggregated_renders_one_engine_pool_and_no_prefill() -> None:
    objs = by_kind_name(render(isvc(mode="Aggregated", decode={"replicas": 2})))
    deployments = sorted(n for k, n in objs if k == "Deployment")
    assert deployments == ["svc-engine", "svc-proxy"]
    engine = objs[("Deployment", "svc-engine")]["spec"]["template"]
    assert engine["metadata"]["labels"]["tandem.dev/role"] == "both"
    args = engine["spec"]["containers"][0]["args"]
    assert args[args.index("--role") + 1] == "both"


def test_proxy_discovers_engines_with_rbac_and_serves_the_endpoint() -> None:
    objs = by_kind_name(
        render(
            isvc(
                proxy={
                    "apiKeySecret": {"name": "keys"},
                    "service": {"type": "LoadBalancer", "port": 80},
                }
            )
        )
    )
    proxy = objs[("Deployment", "svc-proxy")]["spec"]["template"]["spec"]
    assert proxy["serviceAccountName"] == "svc-proxy"
    container = proxy["containers"][0]
    args = container["args"]
    assert args[:2] == ["proxy", "--discovery"] and "--selector" in args
    assert "--api-key" not in args  # kubelet-expanded arguments would show the key in ps
    assert {
        "name": "TANDEM_PROXY_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}},
    } in container["env"]
    role = objs[("Role", "svc-proxy")]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in role[
        "rules"
    ]
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"])
    binding = objs[("RoleBinding", "svc-proxy")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "svc-proxy", "namespace": "ml"}
    ]
    service = objs[("Service", "svc")]
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 80
    assert service["spec"]["selector"] == {
        "tandem.dev/inferenceservice": "svc",
        "tandem.dev/role": "proxy",
    }
    # engines' pods carry the model name the proxy's discovery reads
    engine_meta = objs[("Deployment", "svc-decode")]["spec"]["template"]["metadata"]
    assert engine_meta["annotations"]["tandem.dev/served-model-name"] == "tiny"


def test_autoscaled_role_leaves_replicas_to_its_hpa() -> None:
    objs = by_kind_name(render(isvc(decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 8}})))
    assert "replicas" not in objs[("Deployment", "svc-decode")]["spec"]
    assert objs[("Deployment", "svc-prefill")]["spec"]["replicas"] == 1
    hpa = objs[("HorizontalPodAutoscaler", "svc-decode")]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "svc-decode",
    }


def test_hf_model_gets_a_cache_pvc_and_a_download_job_before_engines() -> None:
    spec = {"model": {"name": "q", "uri": "hf://Qwen/Qwen3-0.6B", "credentialsSecret": "hf"}}
    pending = by_kind_name(render(isvc(**spec), RenderOptions(model_ready=False)))
    assert ("PersistentVolumeClaim", "svc-model-cache") in pending
    job = next(o for (k, _), o in pending.items() if k == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-3:] == [
        "Qwen/Qwen3-0.6B",
        "main",
        "/models/cache/Qwen/Qwen3-0.6B/main",
    ]
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}},
    } in container["env"]
    assert not [
        n for k, n in pending if k == "Deployment" and n != "svc-proxy"
    ]  # engines wait for the model
    ready = by_kind_name(render(isvc(**spec), RenderOptions(model_ready=True)))
    decode = ready[("Deployment", "svc-decode")]["spec"]["template"]["spec"]
    assert decode["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "svc-model-cache",
        "readOnly": True,
    }
    # a new revision is a new Job (a Job's template is immutable)
    other = render(isvc(model={**spec["model"], "revision": "v2"}))
    assert {o["metadata"]["name"] for o in other if o["kind"] == "Job"} != {job["metadata"]["name"]}


def test_existing_cache_claim_is_used_not_created() -> None:
    objs = by_kind_name(
        render(isvc(model={"name": "q", "uri": "hf://a/b", "cache": {"claimName": "shared"}}))
    )
    assert not [k for k, _ in objs if k == "PersistentVolumeClaim"]
    job = next(o for (k, _), o in objs.items() if k == "Job")
    assert (
        job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
        == "shared"
    )


def test_pvc_model_is_mounted_read_only() -> None:
    objs = by_kind_name(render(isvc(model={"name": "m", "uri": "pvc://weights/llama"})))
    pod = objs[("Deployment", "svc-decode")]["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    }
    assert not [k for k, _ in objs if k in ("Job", "PersistentVolumeClaim")]


def test_a_spec_change_changes_the_pod_template_and_nothing_else_does() -> None:
    base = by_kind_name(render(isvc(engine={"maxModelLen": 2048})))
    same = by_kind_name(render(isvc(engine={"maxModelLen": 2048})))
    changed = by_kind_name(render(isvc(engine={"maxModelLen": 4096})))
    key = ("Deployment", "svc-decode")
    assert base == same  # deterministic: re-applying is a no-op
    assert base[key]["spec"]["template"] != changed[key]["spec"]["template"]  # rolls the pods


# ---- status ---------------------------------------------------------------------------------


def deployment(
    role: str, desired: int, ready: int, generation: int = 1, observed: int = 1
) -> DeploymentSummary:
    return DeploymentSummary(
        role=role,
        generation=generation,
        observed_generation=observed,
        desired=desired,
        ready=ready,
        updated=desired,
        available=ready,
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def ready_pods(*deployments: DeploymentSummary, layout: str | None = None) -> list[PodSummary]:
    """The ready pods a Deployment's status counts, as the pod index holds them."""
    role_of = {"both": "both"}
    return [
        PodSummary(role_of.get(d.role, d.role), True, kv_layout=layout)
        for d in deployments
        for _ in range(d.ready)
    ]


def status_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return as_patch(compute_status(*args, **kwargs))


def test_status_ready_when_every_role_is_ready() -> None:
    svc = isvc(prefill={"replicas": 2})
    deployments = [
        deployment("prefill", 2, 2),
        deployment("decode", 1, 1),
        deployment("proxy", 1, 1),
    ]
    kids = Children(deployments=deployments, pods=ready_pods(*deployments))
    status = status_dict(svc, plan(svc), kids, observed_generation=1, now="t0")
    assert status["phase"] == "Ready" and status["observedGeneration"] == 1
    assert status["url"] == "http://svc.ml.svc.cluster.local:8000/v1"
    assert status["prefill"] == {
        "desired": 2,
        "ready": 2,
        "updated": 2,
        "available": 2,
        "replicas": "2/2",
    }
    cond = conditions(status)
    assert cond["Ready"] == ("True", "AllRolesReady")
    assert cond["Progressing"][0] == "False" and cond["Degraded"] == ("False", "AsExpected")
    assert cond["PrefillReady"][0] == cond["DecodeReady"][0] == cond["ProxyReady"][0] == "True"


def test_status_waiting_for_gpus_when_pods_are_unschedulable() -> None:
    svc = isvc()
    kids = Children(
        deployments=[
            deployment("prefill", 1, 1),
            deployment("decode", 1, 0),
            deployment("proxy", 1, 1),
        ],
        pods=[
            PodSummary("decode", False, "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
        ],
    )
    status = status_dict(svc, plan(svc), kids, observed_generation=1, now="t0")
    cond = conditions(status)
    assert cond["Ready"] == ("False", "WaitingForGPUs")
    assert cond["DecodeReady"] == ("False", "WaitingForGPUs") and cond["Degraded"] == (
        "True",
        "WaitingForGPUs",
    )
    assert status["phase"] == "Degraded"


def test_status_not_ready_until_the_new_generation_is_rolled_out() -> None:
    svc = isvc(generation=2)
    kids = Children(
        deployments=[
            deployment("prefill", 1, 1, generation=2, observed=1),
            deployment("decode", 1, 1),
            deployment("proxy", 1, 1),
        ]
    )
    status = status_dict(svc, plan(svc), kids, observed_generation=2, now="t0")
    assert conditions(status)["Ready"][0] == "False"
    assert conditions(status)["Progressing"] == ("True", "RollingUpdate")
    # the spec was not applied yet: not Ready even if every Deployment looks done
    done = Children(
        deployments=[
            deployment("prefill", 1, 1),
            deployment("decode", 1, 1),
            deployment("proxy", 1, 1),
        ]
    )
    assert status_dict(svc, plan(svc), done, observed_generation=1, now="t0")["phase"] != "Ready"


def test_status_downloading_then_failed_download_is_degraded() -> None:
    svc = isvc(model={"name": "q", "uri": "hf://a/b"})
    kids = Children(deployments=[deployment("proxy", 1, 1)])
    status = status_dict(svc, plan(svc), kids, observed_generation=1, now="t0")
    assert status["phase"] == "Downloading" and conditions(status)["DecodeReady"] == (
        "False",
        "WaitingForModel",
    )
    failed = Children(
        deployments=kids.deployments,
        jobs=[JobSummary("svc-download-x", succeeded=False, failed=True)],
    )
    status = status_dict(svc, plan(svc), failed, observed_generation=1, now="t0")
    assert conditions(status)["Degraded"] == ("True", "DownloadFailed")


def test_condition_transition_time_moves_only_on_a_change() -> None:
    svc = isvc()
    deployments = [
        deployment("prefill", 1, 1),
        deployment("decode", 1, 1),
        deployment("proxy", 1, 1),
    ]
    ready = Children(deployments=deployments, pods=ready_pods(*deployments))
    first = compute_status(svc, plan(svc), ready, 1, now="t0")
    again = compute_status(svc, plan(svc), ready, 1, now="t1", previous=first)
    assert {c.last_transition_time for c in again.conditions} == {"t0"}
    broken = Children(
        deployments=[deployment("prefill", 1, 0), *ready.deployments[1:]],
        pods=ready_pods(*ready.deployments[1:]),
    )
    after = compute_status(svc, plan(svc), broken, 1, now="t2", previous=again)
    times = {c.type: c.last_transition_time for c in after.conditions}
    assert times["Ready"] == times["PrefillReady"] == "t2" and times["DecodeReady"] == "t0"


def test_engines_get_the_internal_credential_from_a_secret_and_a_network_policy() -> None:
    """Issue 11, findings 3 and 6: engine pods refuse callers without the internal credential
    (they get it from a Secret, as an environment variable), no key is ever an argument, and
    only their own InferenceService's pods can reach them."""
    spec = isvc(
        prefill={"replicas": 1}, decode={"replicas": 2}, proxy={"apiKeySecret": {"name": "keys"}}
    )
    objs = by_kind_name(render(spec))
    ref = {
        "name": "TANDEM_INTERNAL_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "svc-internal", "key": "internal-api-key"}},
    }
    for name in ("svc-prefill", "svc-decode", "svc-proxy"):
        container = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert ref in container["env"], name
        assert not any("key" in arg.lower() for arg in container["args"]), container["args"]
        assert not any("value" in e and "KEY" in e["name"] for e in container["env"])
    policy = objs[("NetworkPolicy", "svc-engines")]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == UID
    spec_ = policy["spec"]
    assert spec_["policyTypes"] == ["Ingress"]
    engine_labels = objs[("Deployment", "svc-decode")]["spec"]["template"]["metadata"]["labels"]
    proxy_labels = objs[("Deployment", "svc-proxy")]["spec"]["template"]["metadata"]["labels"]
    selected = spec_["podSelector"]["matchLabels"]
    assert selected.items() <= engine_labels.items()
    assert not selected.items() <= proxy_labels.items()  # the public proxy is not locked down
    peers, scraper = spec_["ingress"]
    peer_labels = peers["from"][0]["podSelector"]["matchLabels"]
    assert "ports" not in peers  # HTTP and the KV transport's port
    assert (
        peer_labels.items() <= proxy_labels.items() and peer_labels.items() <= engine_labels.items()
    )
    assert "namespaceSelector" not in peers["from"][0]  # this namespace only
    # another InferenceService's pods are not peers
    other = by_kind_name(render(load_inference_service({**spec_body("other")})))
    other_labels = other[("Deployment", "other-engine")]["spec"]["template"]["metadata"]["labels"]
    assert not peer_labels.items() <= other_labels.items()
    assert scraper["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert scraper["from"][0]["podSelector"]["matchLabels"] == {
        "tandem.dev/metrics-scraper": "true"
    }


def spec_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"mode": "Aggregated", "model": {"name": "tiny", "uri": "/models/tiny"}},
    }


def test_internal_credential_secret_is_rendered_from_the_given_token() -> None:
    spec = isvc()
    topology = plan(spec)
    secret = internal_credential_secret(spec, topology, "tok")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "svc-internal"
    assert secret["stringData"] == {"internal-api-key": "tok"}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    assert ("Secret", "svc-internal") not in by_kind_name(render(spec))  # created once, not applied


def test_a_retained_cache_renders_without_a_uid() -> None:
    """``tandem operator --render`` renders a file's object, which has no uid yet: the
    retained cache claim (no owner either way) must not need one."""
    body = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ml"},
        "spec": {"model": {"name": "m", "uri": "hf://a/b", "cache": {"retain": True}}},
    }
    objs = by_kind_name(render(load_inference_service(body)))
    claim = objs[("PersistentVolumeClaim", "svc-model-cache")]
    assert "ownerReferences" not in claim["metadata"]


@pytest.mark.parametrize(
    "example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_operator_render_prints_every_example(example: Path, capsys) -> None:
    """``tandem operator --render FILE`` (docs/operator.md) on each shipped example, a
    multi-document one (a ConfigMap beside the service) included."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--render", str(example)])) == 0
    kinds = {m["kind"] for m in yaml.safe_load_all(capsys.readouterr().out)}
    assert {"Deployment", "Service"} <= kinds
