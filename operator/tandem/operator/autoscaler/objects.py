"""A role's autoscaler as Kubernetes objects. Pure.

``spec.<role>.autoscaling.backend`` picks who writes a pool's replicas:

* ``HPA``: a HorizontalPodAutoscaler on a per-pod custom metric (the engines'
  ``tandem:num_requests_waiting``, which prometheus-adapter exposes as
  ``tandem_num_requests_waiting``; the chart's adapter rules do that).
* ``KEDA``: a ScaledObject whose Prometheus trigger queries the same metric, summed over the
  pool, against the same per-pod target; with ``minReplicas: 0`` a second trigger on the
  proxy's request counter activates the pool from zero (KEDA's activation phase, which an
  HPA cannot do).
* ``Planner``: nothing here; the operator's SLO planner writes the pool's scale subresource.

The queries select series by the labels the chart's PodMonitor attaches to every engine and
proxy target: ``namespace``, and the pod labels ``tandem.dev/inferenceservice`` and
``tandem.dev/role`` as ``tandem_dev_inferenceservice`` and ``tandem_dev_role``.
"""

from __future__ import annotations

from typing import Any

from ..spec.autoscaling import Autoscaling

Manifest = dict[str, Any]

KEDA_API_VERSION = "keda.sh/v1alpha1"
QUEUE_METRIC = "tandem:num_requests_waiting"
"""What every backend scales on: requests an engine has accepted but not yet scheduled."""
DEMAND_METRIC = "tandem_proxy_requests_total"
"""The proxy's count of requests answered, refused ones included: traffic that must wake a
pool at zero (a refused request is counted before its 503 goes out)."""
UNSERVED_METRIC = "tandem_proxy_unserved_requests_total"
"""Requests the proxy refused because no engine was running: demand seen while at zero."""
POLLING_SECONDS = 15
COOLDOWN_SECONDS = 300
"""Idle time before KEDA scales a pool to zero: longer than a model load, so a pool that
just woke up is not put back to sleep between two bursts."""
SCALE_DOWN_WINDOW_SECONDS = 300


def queue_query(namespace: str, instance: str, role: str) -> str:
    """The pool's waiting requests, summed over its pods (KEDA divides by the target)."""
    return (
        f'sum({QUEUE_METRIC}{{namespace="{namespace}",'
        f'tandem_dev_inferenceservice="{instance}",tandem_dev_role="{role}"}})'
    )


def demand_query(namespace: str, instance: str) -> str:
    """Requests reaching the InferenceService's proxy in the last two minutes."""
    return (
        f'sum(increase({DEMAND_METRIC}{{namespace="{namespace}",'
        f'tandem_dev_inferenceservice="{instance}"}}[2m]))'
    )


def horizontal_pod_autoscaler(
    a: Autoscaling, metadata: dict[str, Any], target: str, metric: str, average: str
) -> Manifest:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric},
                        "target": {"type": "AverageValue", "averageValue": average},
                    },
                }
            ],
        },
    }


def scaled_object(
    a: Autoscaling,
    metadata: dict[str, Any],
    target: str,
    role: str,
    average: str,
) -> Manifest:
    """KEDA's ScaledObject for one pool; KEDA creates and owns the HPA behind it."""
    namespace, instance = metadata["namespace"], metadata["labels"]["app.kubernetes.io/instance"]
    triggers: list[dict[str, Any]] = [
        {
            "type": "prometheus",
            "name": "queue",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": a.prometheus_address,
                "query": queue_query(namespace, instance, role),
                "threshold": average,
                "activationThreshold": "0",
                "ignoreNullValues": "true",
            },
        }
    ]
    if a.min_replicas == 0:
        triggers.append(
            {
                "type": "prometheus",
                "name": "demand",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": a.prometheus_address,
                    "query": demand_query(namespace, instance),
                    # any request activates; the queue trigger sizes the pool once it runs
                    "threshold": "1000000",
                    "activationThreshold": "0",
                    "ignoreNullValues": "true",
                },
            }
        )
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": POLLING_SECONDS,
            "cooldownPeriod": COOLDOWN_SECONDS,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "name": f"keda-{target}",
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_SECONDS}
                    },
                }
            },
            "triggers": triggers,
        },
    }


def autoscaler_objects(
    a: Autoscaling | None, metadata: dict[str, Any], target: str, role: str, hpa_metric: str
) -> list[Manifest]:
    """The objects that scale one pool (none for ``Planner`` or a fixed pool)."""
    if a is None or a.backend == "Planner":
        return []
    if a.backend == "KEDA":
        return [scaled_object(a, metadata, target, role, a.target_average_value)]
    return [horizontal_pod_autoscaler(a, metadata, target, hpa_metric, a.target_average_value)]
