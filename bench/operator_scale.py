"""Operator benchmark on the real control plane (e2e/cluster): apply->Ready latency, and the
time, CPU and memory the operator needs to reconcile many InferenceServices.

    python bench/operator_scale.py [--count 200] [--latency-runs 3]

It also prints the Ready lag after the pods (the last service's status behind the last
engine pod's Ready) and the Events posted per service.

Baseline beside it, in the same run: the same manifests server-side applied straight from
this process by the same client (no operator, no watches, no status), and their Deployments
waited for. The ratio says what the operator adds on top of the API server's own work.
Each InferenceService is Aggregated with one CPU engine replica (tiny CPU/memory requests)
and no proxy replica, so the 200 pods fit kwok's two fake nodes (110 pods each); every child
object is still rendered, applied, watched and reflected in status. Without a proxy a fleet
service is never Ready (no serving path): it counts as done when its engines are
(``DecodeReady``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.cluster import Cluster, NodeShape, bin_dir, missing_binaries  # noqa: E402
from e2e.pools import operator_process  # noqa: E402
from tandem.operator.kube import Kube, load_config  # noqa: E402
from tandem.operator.render.manifests import render  # noqa: E402
from tandem.operator.spec.inference_service import load_inference_service  # noqa: E402


def isvc(name: str, namespace: str, replicas: int = 1, proxy: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "mode": "Aggregated",
            "model": {"name": "tiny", "uri": "/opt/models/tiny"},
            "decode": {
                "replicas": replicas,
                "gpus": 0,
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            },
            "proxy": {"replicas": proxy},
        },
    }


def proc_stats(pid: int) -> tuple[float, int, int]:
    """(cpu seconds, rss KiB, peak rss KiB) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )
    return cpu, int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def wait(what: str, check: Any, timeout: float, interval: float = 0.2) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def ready_count(kube: Kube, namespace: str, condition: str = "Ready") -> int:
    items = kube.request(
        "GET", f"/apis/tandem.dev/v1alpha1/namespaces/{namespace}/inferenceservices"
    )["items"]
    return sum(
        1
        for i in items
        if (i.get("status") or {}).get("observedGeneration") == 1
        and any(
            c["type"] == condition and c["status"] == "True"
            for c in i["status"].get("conditions") or []
        )
    )


def ready_lag(kube: Kube, namespace: str) -> float:
    """Seconds from the last engine pod turning Ready to the last InferenceService showing
    it (``DecodeReady``), both from the API server's lastTransitionTime."""

    def stamp(conditions: list[dict[str, Any]], type_: str) -> float:
        value = next((c["lastTransitionTime"] for c in conditions if c["type"] == type_), None)
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")) if value else 0.0

    pods = kube.list("v1", "Pod", namespace, "app.kubernetes.io/component=engine")
    isvcs = kube.list("tandem.dev/v1alpha1", "InferenceService", namespace, "")
    last_pod = max(stamp(p["status"].get("conditions") or [], "Ready") for p in pods)
    last_isvc = max(stamp(i["status"].get("conditions") or [], "DecodeReady") for i in isvcs)
    return last_isvc - last_pod


def crd_established(kube: Kube) -> bool:
    crd = kube.request(
        "GET",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceservices.tandem.dev",
    )
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def deployments_ready(kube: Kube, namespace: str, want: int) -> bool:
    items = kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")["items"]
    done = sum(
        1
        for d in items
        if (d.get("status") or {}).get("readyReplicas", 0) >= d["spec"].get("replicas", 1)
    )
    return done >= want


def pods_gone(kube: Kube, namespace: str) -> bool:
    return not kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--latency-runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--operator-log-level", default="info")
    parser.add_argument(
        "--pods-per-node",
        default="110",
        help="each of kwok's two nodes' pod capacity (raise it past 110 for --count > 200)",
    )
    args = parser.parse_args()
    if missing_binaries(bin_dir()):
        print("control plane binaries missing: run bash e2e/setup.sh", file=sys.stderr)
        return 2

    state = Path(tempfile.mkdtemp(prefix="tandem-bench-operator-"))
    print(f"state and logs in {state}", file=sys.stderr)
    cluster = Cluster(state / "cluster", nodes=NodeShape(pods=args.pods_per_node))
    operator: subprocess.Popen[bytes] | None = None
    try:
        cluster.start()
        kube = Kube(load_config(str(cluster.kubeconfig)))
        cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        # not `kubectl wait`: it errors out while the new CRD has no conditions yet
        wait("the CRD Established", lambda: crd_established(kube), 60)
        for ns in ("latency", "fleet", "baseline"):
            cluster.kubectl("create", "namespace", ns)
        wait(
            "default ServiceAccounts",
            lambda: all(
                cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0
                for ns in ("latency", "fleet", "baseline")
            ),
            60,
        )

        # Baseline: the same children applied directly, then their Deployments Ready.
        manifests = [
            m
            for i in range(args.count)
            for m in render(load_inference_service(isvc(f"svc-{i:03d}", "baseline")))
        ]
        t0 = time.monotonic()
        for m in manifests:
            kube.apply(m)
        base_apply = time.monotonic() - t0
        wait(
            "baseline deployments",
            lambda: deployments_ready(kube, "baseline", 2 * args.count),
            args.timeout,
            1,
        )
        base_total = time.monotonic() - t0
        cluster.kubectl("delete", "namespace", "baseline", "--wait=false")
        wait("baseline pods to go", lambda: pods_gone(kube, "baseline"), args.timeout, 1)

        operator = operator_process(
            cluster,
            state / "operator.log",
            "--resync-seconds",
            "600",
            "--log-level",
            args.operator_log_level,
        )
        time.sleep(3)
        _, idle_rss, _ = proc_stats(operator.pid)

        # Apply -> Ready for one InferenceService (Disaggregated, 1+1 GPU engines, 1 proxy).
        latencies = []
        for run in range(args.latency_runs):
            name = f"lat-{run}"
            body = {
                "apiVersion": "tandem.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": name, "namespace": "latency"},
                "spec": {"model": {"name": "tiny", "uri": "/opt/models/tiny"}},
            }
            t0 = time.monotonic()
            cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
            wait(
                f"{name} Ready", lambda want=run + 1: ready_count(kube, "latency") == want, 120, 0.1
            )
            latencies.append(time.monotonic() - t0)

        # The fleet: N InferenceServices at once.
        cpu0, _, _ = proc_stats(operator.pid)
        docs = "\n---\n".join(json.dumps(isvc(f"svc-{i:03d}", "fleet")) for i in range(args.count))
        t0 = time.monotonic()
        cluster.kubectl("apply", "-f", "-", input=docs, timeout=args.timeout)
        applied = time.monotonic() - t0
        wait(
            f"{args.count} InferenceServices Ready",
            lambda: ready_count(kube, "fleet", "DecodeReady") == args.count,
            args.timeout,
            1,
        )
        fleet = time.monotonic() - t0
        cpu1, rss, peak = proc_stats(operator.pid)
        time.sleep(15)  # settle: events after Ready must not make the operator write more
        cpu2, _, _ = proc_stats(operator.pid)
        lag = ready_lag(kube, "fleet")
        events = [
            e
            for e in (kube.request("GET", "/api/v1/namespaces/fleet/events") or {})["items"]
            if e["involvedObject"]["kind"] == "InferenceService"
        ]
        reasons = sorted({e["reason"] for e in events})

        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        print(
            f"apply -> Ready (Disaggregated, 1 prefill + 1 decode + proxy), {args.latency_runs} runs: "
            + ", ".join(f"{x:.2f}s" for x in latencies)
            + f"; median {sorted(latencies)[len(latencies) // 2]:.2f}s"
        )
        print(
            f"{args.count} InferenceServices ({len(manifests)} child objects, {args.count} pods):"
        )
        print(
            f"  baseline (direct SSA, no operator): applied in {base_apply:.1f}s, Deployments Ready after "
            f"{base_total:.1f}s"
        )
        print(
            f"  operator: kubectl apply {applied:.1f}s, all Ready (status written) after {fleet:.1f}s "
            f"= {fleet / base_total:.2f}x baseline"
        )
        print(
            f"  operator CPU {cpu1 - cpu0:.1f}s for the fleet ({(cpu1 - cpu0) / args.count * 1000:.0f} ms per "
            f"InferenceService); {cpu2 - cpu1:.2f}s in the 15s after"
        )
        print(
            f"  operator RSS idle {idle_rss / 1024:.0f} MiB, after {rss / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB"
        )
        print(
            f"  Ready lag after pods: the last service DecodeReady {lag:.0f}s after the last "
            "engine pod Ready (API server timestamps, 1 s resolution)"
        )
        print(
            f"  Events on InferenceServices: {len(events)} ({len(events) / args.count:.2f} per "
            f"service; reasons {', '.join(reasons)})"
        )
        return 0
    finally:
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                operator.kill()
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
