"""Planner-driven pools on the real control plane, in simulated time.

The operator's Planner backend reads Prometheus every 15 s of wall clock; a replay of a
two-hour trace, or a test, needs the same code driven by *its* clock and *its* load. So:

* :class:`MetricSource` plays Prometheus for the planner: it answers exactly the PromQL
  that :func:`tandem.operator.autoscaler.metrics.queries` asks (any other query is an error, so a
  changed query cannot pass unnoticed) with the samples its driver set;
* :class:`PlannerPools` creates a Disaggregated InferenceService with the ``Planner``
  backend pointed at that source, and runs the operator's own planning round,
  :func:`tandem.operator.autoscaler.loop.run_planner`, at the driver's ``now``: it reads the
  profile ConfigMap and the pools' ``scale`` subresources from the API server and patches
  them. The operator (running with ``--no-planner``) reconciles the service, the
  Deployment controller creates and deletes pods, the scheduler binds them to kwok's fake
  GPU nodes, and kwok makes them Ready; :meth:`PlannerPools.settle` waits for that and
  returns the Ready pods per pool.

Used by ``bench/autoscale.py --cluster`` and ``e2e/test_autoscaling.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes import config

from e2e.cluster import Cluster, wait_for
from e2e.utils import _isvc
from tandem.operator.autoscaler.loop import run_planner
from tandem.operator.autoscaler.metrics import queries
from tandem.operator.autoscaler.planner import Decision, PlannerState
from tandem.operator.autoscaler.profile import PROFILE_KEY, EngineProfile
from tandem.operator.kube import Kube
from tandem.operator.spec.inference_service import load_inference_service

ROOT = Path(__file__).resolve().parents[1]


class MetricSource:
    """A loopback HTTP server that answers the planner's instant queries like Prometheus."""

    def __init__(self, namespace: str, instance: str) -> None:
        self.by_query = {q: key for key, q in queries(namespace, instance).items()}
        self.samples: dict[str, float | None] = {}
        self.asked: list[str] = []
        source = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query).get("query", [""])[0]
                key = source.by_query.get(query)
                if url.path != "/api/v1/query" or key is None:
                    self.send_error(400, f"not a planner query: {query!r}")
                    return
                source.asked.append(key)
                value = source.samples.get(key)
                result = [] if value is None else [{"metric": {}, "value": [0, str(value)]}]
                body = json.dumps(
                    {"status": "success", "data": {"resultType": "vector", "result": result}}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class PoolSpec:
    """The service the planner sizes: its SLO, its profile, each pool's bounds."""

    ttft_ms: float
    itl_ms: float
    profile: EngineProfile
    prefill_max: int
    decode_max: int
    surge: float = 0.75
    min_replicas: int = 1


def manifests(
    name: str, namespace: str, spec: PoolSpec, address: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The profile ConfigMap and the InferenceService (Planner backend on both pools)."""
    profile = f"{name}-profile"
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": profile, "namespace": namespace},
        "data": {PROFILE_KEY: json.dumps(spec.profile.to_dict())},
    }

    def pool(top: int) -> dict[str, Any]:
        return {
            "autoscaling": {
                "backend": "Planner",
                "minReplicas": spec.min_replicas,
                "maxReplicas": top,
                "prometheusAddress": address,
            }
        }

    isvc = _isvc(
        name,
        namespace,
        mode="Disaggregated",
        slo={
            "ttftMs": spec.ttft_ms,
            "itlMs": spec.itl_ms,
            "surge": spec.surge,
            "profileConfigMap": profile,
        },
        prefill=pool(spec.prefill_max),
        decode=pool(spec.decode_max),
    )
    return configmap, isvc


class PlannerPools:
    """One planned service on the cluster, driven round by round."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, spec: PoolSpec) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.source = MetricSource(namespace, name)
        configmap, body = manifests(name, namespace, spec, self.source.url)
        self.body = body
        self.isvc = load_inference_service(json.dumps(body))
        self.kube = Kube(config.new_client_from_config(config_file=str(cluster.kubeconfig)))
        self.state: PlannerState | None = None
        for obj in (configmap, body):
            cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def wait_for_pools(self, timeout: float = 90.0) -> None:
        """Until the operator has created both Deployments and their first pods are Ready."""
        wait_for(
            "both pools' Deployments",
            lambda: all(self._deployment(r) for r in ("prefill", "decode")),
            timeout,
        )
        wait_for("the first pods Ready", lambda: self.ready() == self.desired() != (0, 0), timeout)

    def round(self, now: float, samples: dict[str, float | None]) -> Decision:
        """One planning round of the operator's code at ``now``, on these metrics."""
        self.source.samples = samples
        decision = run_planner(self.kube, self.isvc, self.state, now)
        self.state = decision.state
        return decision

    def ready(self) -> tuple[int, int]:
        """Pods that are Ready and not being deleted, per pool."""
        return self._ready("prefill"), self._ready("decode")

    def desired(self) -> tuple[int, int]:
        return tuple(  # type: ignore[return-value]
            int((self._deployment(r) or {}).get("spec", {}).get("replicas") or 0)
            for r in ("prefill", "decode")
        )

    def settle(self, timeout: float = 60.0) -> tuple[int, int]:
        """The Ready pods per pool once they match the scale the planner set (or at the
        timeout: then what is Ready, e.g. fewer when the nodes' GPUs run out)."""
        try:
            wait_for("the pools' Ready pods", lambda: self.ready() == self.desired(), timeout)
        except TimeoutError:
            pass
        return self.ready()

    def stop(self) -> None:
        self.source.stop()
        self.cluster.kubectl("delete", "tisvc", self.name, "-n", self.namespace, check=False)

    def _deployment(self, role: str) -> dict[str, Any] | None:
        return self.kube.request(
            "GET",
            f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.name}-{role}",
            ok_missing=True,
        )

    def _ready(self, role: str) -> int:
        pods = self.kube.request(
            "GET",
            f"/api/v1/namespaces/{self.namespace}/pods",
            query=[
                (
                    "labelSelector",
                    f"tandem.dev/inferenceservice={self.name},tandem.dev/role={role}",
                )
            ],
        )
        return sum(
            1
            for p in (pods or {}).get("items", [])
            if not p["metadata"].get("deletionTimestamp")
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions") or []
            )
        )


def start_operator(cluster: Cluster, namespace: str, log: Path) -> subprocess.Popen[bytes]:
    """``tandem operator --no-planner`` on this namespace, with the admin kubeconfig (the
    bench's own cluster; the e2e tests run it under the chart's ServiceAccount instead)."""
    flags = ["--namespace", namespace, "--no-planner", "--image", "tandem:bench"]
    return operator_process(cluster, log, *flags)


def operator_process(cluster: Cluster, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``tandem operator`` with the cluster's admin kubeconfig, no liveness server and these
    flags, its output in ``log`` (the benches' operator, outside the cluster)."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.server.cli", "operator"]
            + ["--kubeconfig", str(cluster.kubeconfig), "--liveness", "", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=ROOT,
        )
