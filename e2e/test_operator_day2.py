"""Issue 31, the operator on day two, on the real control plane: each of its problems 1-5
reproduced as a platform engineer meets it, and shown fixed.

kwok runs no containers, so what the kubelet would say (image pulls, crash loops) is unit
tested from pod statuses (tests/operator/test_status.py); what the API server, the
scheduler and the controllers say (names, quotas, admission, PriorityClasses, rollouts,
autoscalers) is tested here.
"""

from __future__ import annotations

from e2e.cluster import Cluster
from e2e.utils import Operator, _apply, _get, _isvc, _wait_ready

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
