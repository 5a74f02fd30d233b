"""A smoke test of the test cluster itself: the control plane the other e2e suites run on is
the version it was built from, and its fake nodes are Ready and advertise GPUs.

Kubernetes' own behaviour (scheduling, garbage collection, CEL, server-side apply) is not
ours to test; the operator and proxy suites exercise what Tandem relies on.
"""

from __future__ import annotations

from e2e.cluster import Cluster, read_versions
from e2e.cluster.harness import FAKE_NODE_LABEL, GPU_RESOURCE


def test_the_cluster_is_up_with_ready_gpu_nodes(cluster: Cluster) -> None:
    server = cluster.kubectl_json("version")["serverVersion"]
    assert server["gitVersion"] == read_versions().kubernetes
    nodes = cluster.kubectl_json("get", "nodes", "-l", f"{FAKE_NODE_LABEL}=true")["items"]
    assert len(nodes) == cluster.nodes.count
    for node in nodes:
        assert node["status"]["allocatable"][GPU_RESOURCE] == str(cluster.nodes.gpus)
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert ready["Ready"] == "True"
