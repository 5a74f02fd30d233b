"""Behaviour only a real control plane has: scheduling on extended resources,
garbage collection, CEL validation, structural pruning, the status subresource,
resourceVersion conflicts, server-side apply field ownership and Helm releases.

Every wait is bounded; every test works in its own namespace (or cleans up
the cluster-scoped objects it made) so the tests do not depend on order.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster, read_versions, wait_for
from e2e.cluster.harness import FAKE_NODE_LABEL, GPU_RESOURCE

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # never pulled: kwok fakes the container


def _manifest(obj: dict[str, Any]) -> str:
    return json.dumps(obj)


def _gpu_pod_spec(gpus: int) -> dict[str, Any]:
    return {
        "containers": [
            {
                "name": "engine",
                "image": PAUSE_IMAGE,
                "resources": {"limits": {GPU_RESOURCE: str(gpus)}, "requests": {"cpu": "1"}},
            }
        ],
        "terminationGracePeriodSeconds": 0,
    }


def _pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]


def _gone(cluster: Cluster, *args: str) -> bool:
    result = cluster.kubectl("get", *args, check=False)
    return result.returncode != 0 and "NotFound" in result.stderr


def test_apiserver_reports_the_version_it_was_built_from(cluster: Cluster) -> None:
    server = cluster.kubectl_json("version")["serverVersion"]
    assert server["gitVersion"] == read_versions().kubernetes


def test_fake_nodes_advertise_gpus_and_are_ready(cluster: Cluster) -> None:
    nodes = cluster.kubectl_json("get", "nodes", "-l", f"{FAKE_NODE_LABEL}=true")["items"]
    assert len(nodes) == cluster.nodes.count
    for node in nodes:
        assert node["status"]["allocatable"][GPU_RESOURCE] == str(cluster.nodes.gpus)
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert ready["Ready"] == "True"


def test_gpu_deployment_is_scheduled_onto_gpu_nodes_and_runs(
    cluster: Cluster, namespace: str
) -> None:
    """4 replicas x 4 GPUs fill 2 nodes x 8 GPUs: the scheduler must put two on each node."""
    per_pod = cluster.nodes.gpus // 2
    replicas = 2 * cluster.nodes.count
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine", "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {"metadata": {"labels": {"app": "engine"}}, "spec": _gpu_pod_spec(per_pod)},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=_manifest(deployment))
    cluster.kubectl("rollout", "status", "deployment/engine", "-n", namespace, "--timeout=120s")

    pods = _pods(cluster, namespace, "app=engine")
    assert len(pods) == replicas
    assert all(p["status"]["phase"] == "Running" for p in pods)
    per_node: dict[str, int] = {}
    for pod in pods:
        per_node[pod["spec"]["nodeName"]] = per_node.get(pod["spec"]["nodeName"], 0) + 1
    assert sorted(per_node.values()) == [2] * cluster.nodes.count

    # Free the GPUs for the other tests before returning.
    cluster.kubectl(
        "delete", "deployment", "engine", "-n", namespace, "--wait=true", "--timeout=60s"
    )
    wait_for(
        "engine pods to be deleted", lambda: not _pods(cluster, namespace, "app=engine"), timeout=60
    )


def test_pod_asking_more_gpus_than_any_node_has_stays_pending(
    cluster: Cluster, namespace: str
) -> None:
    """9 GPUs: the cluster has 16 in total but no node has 9, so the scheduler must refuse."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-big", "namespace": namespace},
        "spec": _gpu_pod_spec(cluster.nodes.gpus + 1),
    }
    cluster.kubectl("apply", "-f", "-", input=_manifest(pod))

    def unschedulable() -> bool:
        status = cluster.kubectl_json("get", "pod", "too-big", "-n", namespace)["status"]
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in status.get("conditions", [])
        )

    wait_for("too-big to be marked Unschedulable", unschedulable, timeout=60)
    got = cluster.kubectl_json("get", "pod", "too-big", "-n", namespace)
    assert got["status"]["phase"] == "Pending"
    assert not got["spec"].get("nodeName")
    condition = next(c for c in got["status"]["conditions"] if c["type"] == "PodScheduled")
    assert f"Insufficient {GPU_RESOURCE}" in condition["message"]


def test_deleting_an_owner_garbage_collects_its_dependents(
    cluster: Cluster, namespace: str
) -> None:
    cluster.kubectl("create", "configmap", "owner", "-n", namespace, "--from-literal=k=v")
    owner = cluster.kubectl_json("get", "configmap", "owner", "-n", namespace)
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    dependents = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "child-config", "namespace": namespace, "ownerReferences": [ref]},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "child-secret", "namespace": namespace, "ownerReferences": [ref]},
        },
    ]
    for obj in dependents:
        cluster.kubectl("apply", "-f", "-", input=_manifest(obj))

    cluster.kubectl("delete", "configmap", "owner", "-n", namespace, "--cascade=background")
    wait_for(
        "the garbage collector to delete the dependents",
        lambda: (
            _gone(cluster, "configmap", "child-config", "-n", namespace)
            and _gone(cluster, "secret", "child-secret", "-n", namespace)
        ),
        timeout=90,
        interval=1,
    )


def test_deleting_a_deployment_collects_its_replicasets_and_pods(
    cluster: Cluster, namespace: str
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "containers": [{"name": "c", "image": PAUSE_IMAGE}],
                    "terminationGracePeriodSeconds": 0,
                },
            },
        },
    }
    cluster.kubectl("apply", "-f", "-", input=_manifest(deployment))
    cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=120s")
    assert cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=web")["items"]

    cluster.kubectl(
        "delete",
        "deployment",
        "web",
        "-n",
        namespace,
        "--cascade=foreground",
        "--wait=true",
        "--timeout=90s",
    )
    assert not cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=web")["items"]
    wait_for(
        "web pods to be collected", lambda: not _pods(cluster, namespace, "app=web"), timeout=60
    )


CRD_GROUP = "e2e.tandem.dev"
CEL_MESSAGE = "minReplicas must not exceed maxReplicas"


def _crd() -> dict[str, Any]:
    """A CRD with a structural schema, a CEL rule on spec and a status subresource."""
    spec_schema = {
        "type": "object",
        "required": ["minReplicas", "maxReplicas"],
        "properties": {
            "minReplicas": {"type": "integer", "minimum": 0},
            "maxReplicas": {"type": "integer", "minimum": 0},
        },
        "x-kubernetes-validations": [
            {"rule": "self.minReplicas <= self.maxReplicas", "message": CEL_MESSAGE}
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"gpupools.{CRD_GROUP}"},
        "spec": {
            "group": CRD_GROUP,
            "scope": "Namespaced",
            "names": {"plural": "gpupools", "singular": "gpupool", "kind": "GpuPool"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": spec_schema,
                                "status": {
                                    "type": "object",
                                    "properties": {"ready": {"type": "integer"}},
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def gpupool_crd(cluster: Cluster) -> Iterator[str]:
    """The GpuPool CRD, established, for this module's tests."""
    cluster.kubectl("apply", "--server-side", "-f", "-", input=_manifest(_crd()))
    cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/gpupools.{CRD_GROUP}", "--timeout=60s"
    )
    yield f"gpupools.{CRD_GROUP}"
    cluster.kubectl("delete", "crd", f"gpupools.{CRD_GROUP}", "--wait=false", check=False)


def _gpupool(namespace: str, name: str, low: int, high: int, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{CRD_GROUP}/v1",
        "kind": "GpuPool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"minReplicas": low, "maxReplicas": high, **extra},
    }


def test_cel_rule_rejects_an_invalid_object_with_its_message(
    cluster: Cluster, namespace: str, gpupool_crd: str
) -> None:
    cluster.kubectl("apply", "-f", "-", input=_manifest(_gpupool(namespace, "ok", 1, 2)))
    bad = cluster.kubectl(
        "apply", "-f", "-", check=False, input=_manifest(_gpupool(namespace, "bad", 3, 2))
    )
    assert bad.returncode != 0
    assert CEL_MESSAGE in bad.stderr
    assert "Invalid" in bad.stderr
    assert _gone(cluster, gpupool_crd, "bad", "-n", namespace)


def test_structural_schema_prunes_unknown_fields(
    cluster: Cluster, namespace: str, gpupool_crd: str
) -> None:
    obj = _gpupool(namespace, "pruned", 0, 1, unknownField="dropped")
    cluster.kubectl("create", "--validate=false", "-f", "-", input=_manifest(obj))
    stored = cluster.kubectl_json("get", gpupool_crd, "pruned", "-n", namespace)
    assert "unknownField" not in stored["spec"]


def test_status_subresource_and_resource_version_conflicts(
    cluster: Cluster, namespace: str, gpupool_crd: str
) -> None:
    cluster.kubectl("apply", "-f", "-", input=_manifest(_gpupool(namespace, "pool", 1, 4)))
    cluster.kubectl(
        "patch",
        gpupool_crd,
        "pool",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"ready": 3}}',
    )
    # Status written through the main resource is ignored when the subresource is on.
    cluster.kubectl(
        "patch",
        gpupool_crd,
        "pool",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec": {"maxReplicas": 5}, "status": {"ready": 99}}',
    )
    current = cluster.kubectl_json("get", gpupool_crd, "pool", "-n", namespace)
    assert current["status"] == {"ready": 3}
    assert current["spec"]["maxReplicas"] == 5

    stale = dict(current, metadata=dict(current["metadata"], resourceVersion="1"))
    result = cluster.kubectl("replace", "-f", "-", check=False, input=_manifest(stale))
    assert result.returncode != 0
    assert "the object has been modified" in result.stderr


def test_server_side_apply_tracks_field_owners(cluster: Cluster, namespace: str) -> None:
    def config(value: str) -> str:
        return _manifest(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "ssa", "namespace": namespace},
                "data": {"model": value},
            }
        )

    cluster.kubectl(
        "apply", "--server-side", "--field-manager=operator", "-f", "-", input=config("llama")
    )
    clash = cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=human",
        "-f",
        "-",
        input=config("qwen"),
        check=False,
    )
    assert clash.returncode != 0
    assert "conflict" in clash.stderr.lower()

    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=human",
        "--force-conflicts",
        "-f",
        "-",
        input=config("qwen"),
    )
    got = cluster.kubectl_json("get", "configmap", "ssa", "-n", namespace, "--show-managed-fields")
    assert got["data"] == {"model": "qwen"}
    owners = {
        m["manager"]
        for m in got["metadata"]["managedFields"]
        if "f:model" in m.get("fieldsV1", {}).get("f:data", {})
    }
    assert owners == {"human"}  # the forced apply took the field away from "operator"


def _write_chart(root: Path) -> Path:
    """A small chart: a ConfigMap and a Deployment that reads it via a template value."""
    chart = root / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        'apiVersion: v2\nname: demo\nversion: 0.1.0\nappVersion: "1.0"\n'
    )
    (chart / "values.yaml").write_text("replicas: 2\nmodel: tiny\n")
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-config\n"
        "data:\n  model: {{ .Values.model | quote }}\n"
    )
    (chart / "templates" / "deployment.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {{ .Release.Name }}\n"
        "spec:\n  replicas: {{ .Values.replicas }}\n"
        "  selector:\n    matchLabels: {app: {{ .Release.Name }}}\n"
        "  template:\n    metadata:\n      labels: {app: {{ .Release.Name }}}\n"
        "    spec:\n      terminationGracePeriodSeconds: 0\n"
        f"      containers:\n      - name: server\n        image: {PAUSE_IMAGE}\n"
    )
    return chart


def test_helm_install_of_a_small_chart(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    chart = _write_chart(tmp_path)
    cluster.helm(
        "install",
        "demo",
        str(chart),
        "--namespace",
        namespace,
        "--set",
        "model=qwen",
        "--wait",
        "--timeout",
        "120s",
    )
    releases = json.loads(cluster.helm("list", "--namespace", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]
    deployment = cluster.kubectl_json("get", "deployment", "demo", "-n", namespace)
    assert deployment["status"].get("readyReplicas") == 2
    config = cluster.kubectl_json("get", "configmap", "demo-config", "-n", namespace)
    assert config["data"] == {"model": "qwen"}

    cluster.helm("uninstall", "demo", "--namespace", namespace, "--wait", "--timeout", "60s")
    assert _gone(cluster, "configmap", "demo-config", "-n", namespace)


def test_kubectl_failure_is_reported_with_stderr(cluster: Cluster) -> None:
    """The helper raises with kubectl's message, so a failing test explains itself."""
    with pytest.raises(subprocess.CalledProcessError) as err:
        cluster.kubectl("get", "configmap", "does-not-exist", "-n", "default")
    assert "NotFound" in err.value.stderr
