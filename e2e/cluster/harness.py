"""A real, single-machine Kubernetes control plane for e2e tests.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the kwok
controller run as local processes on loopback, the way controller-runtime's
envtest runs its apiserver, plus the controller manager (garbage collection,
namespaces, service accounts, ReplicaSets), the scheduler (real placement,
extended resources) and kwok (fake GPU nodes that go Ready and run pods
without a kubelet or container runtime).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from e2e.cluster import pki, procs
from e2e.cluster.api import Api, ApiError
from e2e.cluster.paths import bin_dir as default_bin_dir

FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_NODE_LABEL = "tandem.dev/fake-node"
GPU_RESOURCE = "nvidia.com/gpu"
_STAGES = Path(__file__).resolve().parent / "kwok-stages.yaml"


GANG_FEATURE_GATES = "GenericWorkload=true,GangScheduling=true"
# One controller-manager and one scheduler, on a machine the tests may starve of CPU: a
# missed 10 s renewal (the default) makes either exit, and the cluster silently stops
# creating ServiceAccounts or scheduling pods. Nothing competes for these leases.
_PATIENT_LEADER_ELECTION = (
    "--leader-elect-lease-duration=120s",
    "--leader-elect-renew-deadline=110s",
    "--leader-elect-retry-period=2s",
)


class ClusterError(RuntimeError):
    """The control plane failed to start or a component died."""


@dataclass(frozen=True)
class NodeShape:
    """What each fake node advertises as capacity (and allocatable)."""

    count: int = 2
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: str = "110"


@dataclass(frozen=True)
class Ports:
    """Loopback ports picked free at start."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    kwok: int


def _free_ports(count: int) -> list[int]:
    """Ask the kernel for distinct free loopback ports (held together so they differ)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _write_kubeconfig(
    path: Path, server: str, ca: pki.CertPair, client: pki.CertPair, user: str
) -> None:
    """kubeconfig referencing the PEM files (JSON is valid kubeconfig YAML)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "tandem-e2e",
                "cluster": {"server": server, "certificate-authority": str(ca.cert)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate": str(client.cert), "client-key": str(client.key)},
            }
        ],
        "contexts": [{"name": "tandem-e2e", "context": {"cluster": "tandem-e2e", "user": user}}],
        "current-context": "tandem-e2e",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.25) -> None:
    """Poll `check` until true; a bounded wait that names what it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (OSError, ApiError, ValueError, KeyError):
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Cluster:
    """One control plane whose state (certs, data, logs, pids) lives in `state_dir`.

    Use as a context manager, or call start()/stop(); stop() is safe to call
    any number of times and also stops processes recorded by an earlier run
    in the same state dir (that is how `python -m e2e.cluster down` works).
    """

    def __init__(
        self,
        state_dir: Path,
        bin_dir: Path | None = None,
        nodes: NodeShape = NodeShape(),
        tie_to_parent: bool = True,
    ) -> None:
        self.state_dir = state_dir.resolve()
        self.bin_dir = (bin_dir or default_bin_dir()).resolve()
        self.nodes = nodes
        self._tie_to_parent = tie_to_parent
        self._procs: list[procs.Managed] = []
        self._api: Api | None = None
        self.ports: Ports | None = None
        self.startup_seconds: float | None = None
        self.phases: dict[str, float] = {}
        """Seconds from start() to each readiness milestone (for the README's figures)."""

    # ---- public helpers -------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client certificate in group system:masters)."""
        return self.state_dir / "kubeconfig"

    def tool_env(self) -> dict[str, str]:
        """Environment for kubectl/helm: our kubeconfig, caches kept inside the state dir."""
        env = dict(os.environ)
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            KUBECACHEDIR=str(self.state_dir / "kube-cache"),
            HELM_CONFIG_HOME=str(self.state_dir / "helm" / "config"),
            HELM_CACHE_HOME=str(self.state_dir / "helm" / "cache"),
            HELM_DATA_HOME=str(self.state_dir / "helm" / "data"),
            PATH=f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}",
        )
        return env

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises CalledProcessError (with stderr) if check."""
        return self._tool("kubectl", args, input, check, timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster."""
        return self._tool("helm", args, input, check, timeout)

    def kubectl_json(self, *args: str) -> Any:
        """`kubectl ... -o json`, decoded."""
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def memory(self) -> dict[str, dict[str, int]]:
        """Current and peak RSS (KiB) per running component, read from /proc."""
        report = {}
        for proc in self._procs:
            rss, hwm = procs.memory_kib(proc.pid)
            report[proc.name] = {"rss_kib": rss, "peak_rss_kib": hwm}
        return report

    # ---- lifecycle ------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 240) -> None:
        """Bring everything up and wait until the cluster can run pods on GPU nodes.

        On any failure every process started so far is stopped before the
        error propagates, so a failed start leaks nothing.
        """
        began = time.monotonic()
        missing = [
            n
            for n in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
            if not (self.bin_dir / n).exists()
        ]
        if missing:
            raise ClusterError(f"missing binaries in {self.bin_dir}: {missing}; run e2e/setup.sh")
        if any(p.alive() for p in procs.recorded(self.state_dir, self.bin_dir)):
            raise ClusterError(f"a cluster is already running from {self.state_dir}; stop it first")
        try:
            self._bring_up(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        self._save_state()

    def stop(self) -> None:
        """Stop controllers first, then the apiserver, then etcd; kill after a grace period."""
        known = {p.pid for p in self._procs}
        leftovers = [p for p in procs.recorded(self.state_dir, self.bin_dir) if p.pid not in known]
        everything = self._procs + leftovers
        if everything:
            self._record_memory()
        by_name = {"etcd": 2, "kube-apiserver": 1}
        for tier in (0, 1, 2):
            group = [p for p in everything if by_name.get(p.name, 0) == tier]
            procs.terminate(group, self.state_dir)
        self._procs = []

    # ---- bring-up steps -------------------------------------------------

    def _bring_up(self, deadline: float) -> None:
        began = time.monotonic()
        self.phases = {}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # A state dir reused after `down` must not resurrect the old cluster's data.
        for stale in ("etcd", "logs", "apiserver", "kube-cache", "helm"):
            shutil.rmtree(self.state_dir / stale, ignore_errors=True)
        self.ports = Ports(*_free_ports(4))
        certs = pki.generate(self.state_dir / "pki")
        server = f"https://127.0.0.1:{self.ports.apiserver}"
        _write_kubeconfig(self.kubeconfig, server, certs.ca, certs.admin, "admin")
        _write_kubeconfig(
            self.state_dir / "controller-manager.kubeconfig",
            server,
            certs.ca,
            certs.controller_manager,
            "system:kube-controller-manager",
        )
        _write_kubeconfig(
            self.state_dir / "scheduler.kubeconfig",
            server,
            certs.ca,
            certs.scheduler,
            "system:kube-scheduler",
        )
        self._api = Api(server, certs.ca, certs.admin)

        self._start("etcd", self._etcd_args())
        self._wait("etcd to be healthy", self._etcd_healthy, deadline, began)
        self._start("kube-apiserver", self._apiserver_args(certs))
        self._wait("kube-apiserver /readyz", self._apiserver_ready, deadline, began)
        self._start("kube-controller-manager", self._controller_manager_args(certs))
        self._start("kube-scheduler", self._scheduler_args())
        self._start("kwok", self._kwok_args())
        self._register_nodes()
        self._wait("fake GPU nodes to be Ready (kwok)", self._nodes_ready, deadline, began)
        self._wait(
            "controller-manager and scheduler leases", self._leaders_elected, deadline, began
        )
        self._wait(
            "the default ServiceAccount (controller-manager)", self._default_sa, deadline, began
        )

    def _start(self, name: str, args: list[str]) -> None:
        proc = procs.spawn(name, self.bin_dir / name, args, self.state_dir, self._tie_to_parent)
        self._procs.append(proc)
        self._save_state()

    def _wait(
        self, what: str, check: Callable[[], bool], deadline: float, began: float | None = None
    ) -> None:
        """wait_for, but fail fast with the log tail if one of our processes died."""

        def guarded() -> bool:
            for proc in self._procs:
                if not proc.alive():
                    raise ClusterError(
                        f"{proc.name} exited while waiting for {what}; "
                        f"log {proc.log}:\n{proc.log_tail()}"
                    )
            return check()

        wait_for(what, guarded, timeout=max(1.0, deadline - time.monotonic()))
        if began is not None:
            self.phases[what] = round(time.monotonic() - began, 2)

    def _etcd_args(self) -> list[str]:
        assert self.ports is not None
        client = f"http://127.0.0.1:{self.ports.etcd_client}"
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        return [
            "--name=default",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync=true",  # test data is throwaway; fsync dominates latency
            "--log-level=warn",
        ]

    def _apiserver_args(self, certs: pki.Pki) -> list[str]:
        assert self.ports is not None
        return [
            f"--etcd-servers=http://127.0.0.1:{self.ports.etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports.apiserver}",
            f"--cert-dir={self.state_dir / 'apiserver'}",
            f"--tls-cert-file={certs.serving.cert}",
            f"--tls-private-key-file={certs.serving.key}",
            f"--client-ca-file={certs.ca.cert}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={certs.sa_pub}",
            f"--service-account-signing-key-file={certs.sa_key}",
            f"--service-cluster-ip-range={pki.SERVICE_CIDR}",
            "--allow-privileged=true",
            # Endpoints may not point at loopback; nothing here needs them.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            # Kubernetes' own gang scheduling (alpha in 1.36): the PodGroup API and the
            # scheduler's GangScheduling plugin, which the operator's --gang-scheduling uses.
            f"--feature-gates={GANG_FEATURE_GATES}",
            "--runtime-config=scheduling.k8s.io/v1alpha2=true",
        ]

    def _controller_manager_args(self, certs: pki.Pki) -> list[str]:
        return [
            f"--kubeconfig={self.state_dir / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--controllers=*",
            f"--feature-gates={GANG_FEATURE_GATES}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={certs.sa_key}",
            f"--root-ca-file={certs.ca.cert}",
            f"--cluster-signing-cert-file={certs.ca.cert}",
            f"--cluster-signing-key-file={certs.ca.key}",
            "--profiling=false",
            *_PATIENT_LEADER_ELECTION,
        ]

    def _scheduler_args(self) -> list[str]:
        return [
            f"--kubeconfig={self.state_dir / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--profiling=false",
            f"--feature-gates={GANG_FEATURE_GATES}",
            *_PATIENT_LEADER_ELECTION,
        ]

    def _kwok_args(self) -> list[str]:
        assert self.ports is not None
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--config={_STAGES}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
            # Without node leases the node lifecycle controller marks the fake nodes unreachable
            # after ~50 s and every pod on them NotReady; kwok renews them with this set.
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{self.ports.kwok}",
            "--cidr=10.244.0.0/16",
            "--node-ip=10.240.0.1",
        ]

    # ---- cluster objects and readiness -----------------------------------

    def fake_node_manifest(self, index: int) -> dict[str, Any]:
        """A Node kwok manages: it advertises GPUs and needs no kubelet."""
        name = f"kwok-gpu-{index}"
        resources = {
            "cpu": self.nodes.cpu,
            "memory": self.nodes.memory,
            "pods": self.nodes.pods,
            GPU_RESOURCE: str(self.nodes.gpus),
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {FAKE_NODE_ANNOTATION: "fake"},
                "labels": {
                    FAKE_NODE_LABEL: "true",
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "nvidia.com/gpu.present": "true",
                },
            },
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "addresses": [
                    {"type": "InternalIP", "address": f"10.240.0.{index + 1}"},
                    {"type": "Hostname", "address": name},
                ],
            },
        }

    def _register_nodes(self) -> None:
        assert self._api is not None
        for index in range(self.nodes.count):
            self._api.create("/api/v1/nodes", self.fake_node_manifest(index))

    def _etcd_healthy(self) -> bool:
        assert self.ports is not None
        url = f"http://127.0.0.1:{self.ports.etcd_client}/health"
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read()).get("health") == "true"

    def _apiserver_ready(self) -> bool:
        assert self._api is not None
        return self._api.request("GET", "/readyz", timeout=5) == "ok"

    def _nodes_ready(self) -> bool:
        assert self._api is not None
        items = self._api.get_json(f"/api/v1/nodes?labelSelector={FAKE_NODE_LABEL}%3Dtrue")["items"]
        ready = [
            n
            for n in items
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        ]
        return len(ready) == self.nodes.count

    def _leaders_elected(self) -> bool:
        assert self._api is not None
        base = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/"
        return all(
            self._api.get_json(base + name)["spec"].get("holderIdentity")
            for name in ("kube-controller-manager", "kube-scheduler")
        )

    def _default_sa(self) -> bool:
        assert self._api is not None
        self._api.get_json("/api/v1/namespaces/default/serviceaccounts/default")
        return True

    # ---- bookkeeping -----------------------------------------------------

    def _tool(
        self, name: str, args: tuple[str, ...], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin_dir / name), *args],
            input=input,
            text=True,
            capture_output=True,
            env=self.tool_env(),
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, [name, *args], result.stdout, result.stderr
            )
        return result

    def _save_state(self) -> None:
        """cluster.json: what `down`, `status` and humans need to find this cluster."""
        state = {
            "bin_dir": str(self.bin_dir),
            "kubeconfig": str(self.kubeconfig),
            "ports": asdict(self.ports) if self.ports else None,
            "pids": {p.name: p.pid for p in self._procs},
            "startup_seconds": self.startup_seconds,
            "phases": self.phases,
        }
        (self.state_dir / "cluster.json").write_text(json.dumps(state, indent=2) + "\n")

    def _record_memory(self) -> None:
        """Keep each component's peak RSS (VmHWM) before it exits: the memory figure."""
        if not self._procs:
            return
        report = self.memory()
        total = sum(v["peak_rss_kib"] for v in report.values())
        out = {"components": report, "sum_peak_rss_mib": round(total / 1024, 1)}
        (self.state_dir / "memory.json").write_text(json.dumps(out, indent=2) + "\n")

    @classmethod
    def attach(cls, state_dir: Path) -> Cluster:
        """A handle on a cluster started by another process (reads cluster.json)."""
        state = json.loads((state_dir / "cluster.json").read_text())
        cluster = cls(state_dir, Path(state["bin_dir"]), tie_to_parent=False)
        cluster._procs = [
            p for p in procs.recorded(cluster.state_dir, cluster.bin_dir) if p.alive()
        ]
        if state.get("ports"):
            cluster.ports = Ports(**state["ports"])
        cluster.startup_seconds = state.get("startup_seconds")
        return cluster
