"""The proxy's Kubernetes discovery against the real control plane.

The objects are the operator's own (``render()`` of two InferenceServices), applied with
kubectl; kwok's fake GPU nodes schedule the pods, give them pod IPs (10.244.x.x) and mark
them Running/Ready. ``tandem proxy --discovery kubernetes`` runs here as a subprocess with
the selector ``plan()`` gives it and a kubeconfig holding the token of the proxy's rendered
ServiceAccount, so the rendered Role is all it may use: a missing permission fails here.

Nothing serves /health at the fake pod IPs (the connection fails, or, in a sandbox whose
gateway answers every address, a 404), so every discovered node stays unhealthy. The registry
keeps a discovered node that has never been healthy for ``--startup-grace`` seconds (it
treats it as a loading engine), so membership is stable for the length of these tests and
comes from the pod watch alone; the tests run the proxy with ``--dead-threshold 1`` to
show that failed health polls do not drop a node inside that grace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.cluster import Cluster, wait_for
from e2e.utils import _account_kubeconfig
from tandem.operator.render.manifests import render
from tandem.operator.spec.inference_service import load_inference_service
from tandem.operator.spec.roles import GPU_RESOURCE
from tandem.operator.topology import engine_selector, plan
from tandem.server.net import free_port

ROOT = Path(__file__).resolve().parents[1]
NAME, OTHER = "chat", "other"
MODEL = "tiny-chat"
API_KEY = "e2e-proxy-key"
ADMIN_KEY = "e2e-proxy-admin"  # /nodes/* is an admin route (docs/security.md)
WAIT = 60  # seconds, every wait


def _isvc(name: str, namespace: str, model: str, **spec: Any) -> Any:
    return load_inference_service(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"name": model, "uri": "/opt/models/tiny"}, **spec},
        }
    )


def _apply(cluster: Cluster, objs: list[dict[str, Any]]) -> None:
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    )


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (
        status.get("phase") == "Running"
        and bool(status.get("podIP"))
        and not pod["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
        )
    )


def _url(pod: dict[str, Any]) -> str:
    port = next(
        p["containerPort"]
        for c in pod["spec"]["containers"]
        for p in c.get("ports") or []
        if p.get("name") == "http"
    )
    return f"http://{pod['status']['podIP']}:{port}"


@dataclass
class Env:
    cluster: Cluster
    namespace: str
    proxy: subprocess.Popen[bytes]
    base: str
    log: Path

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return self.cluster.kubectl_json("get", "pods", "-n", self.namespace, "-l", selector)[
            "items"
        ]

    def nodes(self) -> dict[str, dict[str, Any]]:
        assert self.proxy.poll() is None, f"proxy exited {self.proxy.returncode}:\n{self.tail()}"
        r = httpx.get(
            self.base + "/nodes/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
        )
        r.raise_for_status()
        return r.json()

    def roles(self) -> dict[str, str]:
        return {url: n["role_name"] for url, n in self.nodes().items()}

    def expected(self) -> dict[str, str]:
        """What discovery should show: NAME's Ready engine pods that carry a role, by URL."""
        return {
            _url(p): p["metadata"]["labels"]["tandem.dev/role"]
            for p in self.pods(f"{engine_selector(NAME)},tandem.dev/role")
            if _ready(p)
        }

    def wait_roles(self, what: str, check: Any) -> dict[str, str]:
        try:
            wait_for(what, lambda: check(self.roles()), timeout=WAIT, interval=0.5)
        except TimeoutError:
            print(
                f"proxy nodes: {json.dumps(self.nodes(), indent=1)}\nproxy log:\n{self.tail()}",
                file=sys.stderr,
            )
            raise
        return self.roles()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def env(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    namespace = f"e2e-proxy-{uuid.uuid4().hex[:6]}"
    workdir = tmp_path_factory.mktemp("proxy-discovery")
    cluster.kubectl("create", "namespace", namespace)
    proc: subprocess.Popen[bytes] | None = None
    try:
        wait_for(
            f"ServiceAccount {namespace}/default",
            lambda: (
                cluster.kubectl(
                    "get", "serviceaccount", "default", "-n", namespace, check=False
                ).returncode
                == 0
            ),
            timeout=WAIT,
        )
        # The service under test, P/D, and a second one in the same namespace whose engines
        # the first one's proxy must not pick up.
        main = _isvc(
            NAME,
            namespace,
            MODEL,
            prefill={"replicas": 1, "gpus": 1},
            decode={"replicas": 2, "gpus": 1},
        )
        other = _isvc(OTHER, namespace, "other-model", mode="Aggregated", decode={"replicas": 1})
        objs = render(main) + render(other)
        _apply(cluster, objs)
        topology = plan(main)
        proxy_role = next(r for r in topology.roles if not r.is_engine)
        args = (
            proxy_role.args
        )  # ["proxy", "--discovery", "kubernetes", "--namespace", ..., "--selector", ...]
        assert (
            args[args.index("--selector") + 1] == engine_selector(NAME) == topology.engine_selector
        )

        # Every pod the selector must leave out or wait on is in place before the proxy starts:
        # (1) a decode pod asking for more GPUs than any node has: stays Pending, never a node;
        decode = next(
            o
            for o in objs
            if o["kind"] == "Deployment" and o["metadata"]["name"] == f"{NAME}-decode"
        )
        too_big = json.loads(json.dumps(decode["spec"]["template"]))
        too_big["metadata"].update(name="too-big", namespace=namespace)
        limits = too_big["spec"]["containers"][0]["resources"]
        limits["limits"][GPU_RESOURCE] = limits["requests"][GPU_RESOURCE] = str(
            cluster.nodes.gpus + 1
        )
        # (2) a matching pod without tandem.dev/role: not an engine discovery can place.
        no_role = json.loads(json.dumps(decode["spec"]["template"]))
        no_role["metadata"].update(name="no-role", namespace=namespace)
        del no_role["metadata"]["labels"]["tandem.dev/role"]
        no_role["spec"]["containers"][0].pop("resources")
        _apply(
            cluster,
            [
                {"apiVersion": "v1", "kind": "Pod", **too_big},
                {"apiVersion": "v1", "kind": "Pod", **no_role},
            ],
        )

        kubeconfig = _account_kubeconfig(
            cluster, namespace, f"{NAME}-proxy", workdir / "proxy.kubeconfig"
        )
        port = free_port()
        log = workdir / "proxy.log"
        child_env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        for var in (
            "KUBERNETES_SERVICE_HOST",
            "KUBERNETES_SERVICE_PORT",
        ):  # never in-cluster config here
            child_env.pop(var, None)
        child_env["TANDEM_ADMIN_API_KEY"] = ADMIN_KEY
        with log.open("w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem.server.cli",
                    *args,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--api-key",
                    API_KEY,
                    "--health-interval",
                    "1",
                    "--dead-threshold",
                    "1",
                    "--startup-grace",
                    "600",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=ROOT,
                start_new_session=True,
            )
        env = Env(cluster, namespace, proc, f"http://127.0.0.1:{port}", log)

        def up() -> bool:
            assert proc.poll() is None, f"proxy exited {proc.returncode}:\n{env.tail()}"
            try:
                return httpx.get(env.base + "/health", timeout=2).status_code in (200, 503)
            except httpx.TransportError:
                return False

        wait_for("the proxy to answer", up, timeout=WAIT, interval=0.5)
        yield env
    finally:
        if proc is not None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            print(
                "\n[e2e] proxy log tail:\n"
                + "\n".join((workdir / "proxy.log").read_text(errors="replace").splitlines()[-10:]),
                file=sys.stderr,
            )
        # waited for, so the GPUs these pods hold are free for whatever test runs next
        cluster.kubectl(
            "delete", "namespace", namespace, "--wait=true", "--timeout=60s", check=False
        )


def test_ready_engine_pods_become_nodes_with_their_role_and_model(env: Env) -> None:
    # 1 prefill + 2 decode, all Ready (kwok), each a node at http://<podIP>:<port named http>.
    wait_for("3 Ready engine pods", lambda: len(env.expected()) == 3, timeout=WAIT, interval=0.5)
    expected = env.expected()
    assert sorted(expected.values()) == ["decode", "decode", "prefill"]
    assert all(url.startswith("http://10.244.") and url.endswith(":8000") for url in expected)
    env.wait_roles(
        "the proxy to list exactly the Ready engine pods", lambda got: got == env.expected()
    )

    nodes = env.nodes()
    for node in nodes.values():
        assert node["source"] == "kubernetes"
        assert node["models"] == [MODEL]  # from the tandem.dev/served-model-name annotation
        assert (
            node["role"] == {"prefill": 2, "decode": 3}[node["role_name"]]
        )  # LMDeploy's EngineRole


def test_unreachable_discovered_nodes_stay_listed_inside_the_startup_grace(env: Env) -> None:
    """Fake pod IPs never answer /health with 200: the nodes are unhealthy, counted as failures,
    and, never having been healthy, kept (a loading engine) although --dead-threshold is 1."""
    expected = env.expected()

    def polled(_: dict[str, str]) -> bool:
        return all(n["consecutive_failures"] >= 1 and n["last_error"] for n in env.nodes().values())

    env.wait_roles("every node to have failed a health poll", polled)
    nodes = env.nodes()
    assert {u: n["role_name"] for u, n in nodes.items()} == expected
    assert not any(n["healthy"] for n in nodes.values())
    health = httpx.get(env.base + "/health", timeout=5)
    assert health.status_code == 503  # nothing routable


def _others(env: Env) -> dict[str, list[dict[str, Any]]]:
    """Ready pods in the namespace that the selector must leave out."""
    return {
        "proxy": env.pods(f"tandem.dev/inferenceservice={NAME},app.kubernetes.io/component=proxy"),
        "other service's engine": env.pods(engine_selector(OTHER)),
    }


def test_pods_outside_the_selector_or_not_ready_are_not_nodes(env: Env) -> None:
    wait_for(
        "the proxy pod and the other service's engine pod to be Ready",
        lambda: all(len(pods) == 1 and _ready(pods[0]) for pods in _others(env).values()),
        timeout=WAIT,
        interval=0.5,
    )
    no_role = env.cluster.kubectl_json("get", "pod", "no-role", "-n", env.namespace)
    assert _ready(
        no_role
    )  # matched by the selector and Ready, but no tandem.dev/role: not an engine
    outsiders = {what: pods[0]["status"]["podIP"] for what, pods in _others(env).items()}
    outsiders["no-role"] = no_role["status"]["podIP"]

    def unschedulable() -> bool:
        pod = env.cluster.kubectl_json("get", "pod", "too-big", "-n", env.namespace)
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in pod["status"].get("conditions") or []
        )

    wait_for("too-big to be Unschedulable", unschedulable, timeout=WAIT, interval=0.5)
    too_big = env.cluster.kubectl_json("get", "pod", "too-big", "-n", env.namespace)
    # matched by the selector, role decode, but Pending without an IP: never a node
    assert too_big["metadata"]["labels"]["tandem.dev/role"] == "decode"
    assert too_big["status"]["phase"] == "Pending" and not too_big["status"].get("podIP")

    got = env.roles()
    for what, ip in outsiders.items():
        assert not any(url.startswith(f"http://{ip}:") for url in got), (what, ip, got)
    assert got == env.expected() and len(got) == 3


def test_scaling_down_removes_the_node(env: Env) -> None:
    before = env.roles()
    assert sorted(before.values()) == ["decode", "decode", "prefill"]
    env.cluster.kubectl(
        "scale", "deployment", f"{NAME}-decode", "-n", env.namespace, "--replicas=1"
    )
    after = env.wait_roles(
        "one decode node to be dropped", lambda got: sorted(got.values()) == ["decode", "prefill"]
    )
    assert set(after) < set(before)
    decode_pods = f"{engine_selector(NAME)},tandem.dev/role=decode,pod-template-hash"  # not too-big
    wait_for(
        "the scaled-down pod to be gone",
        lambda: len(env.pods(decode_pods)) == 1,
        timeout=WAIT,
        interval=0.5,
    )
    assert env.roles() == env.expected()


def test_a_deleted_pod_is_dropped_and_its_replacement_added(env: Env) -> None:
    """The Deployment replaces a deleted pod; kwok (like a CNI) may hand the replacement the
    freed IP, so the URL can come back unchanged: the drop is read from the proxy's log."""
    selector = f"{engine_selector(NAME)},tandem.dev/role=prefill"
    prefill = [p for p in env.pods(selector) if _ready(p)]
    assert len(prefill) == 1
    old_uid, old_url = prefill[0]["metadata"]["uid"], _url(prefill[0])
    assert env.roles()[old_url] == "prefill"
    seen = len(env.log.read_text(errors="replace"))
    env.cluster.kubectl(
        "delete", "pod", prefill[0]["metadata"]["name"], "-n", env.namespace, "--wait=false"
    )
    wait_for(
        "the replacement prefill pod to be Ready",
        lambda: (
            [p["metadata"]["uid"] for p in env.pods(selector) if _ready(p)] not in ([], [old_uid])
        ),
        timeout=WAIT,
        interval=0.5,
    )
    wait_for(
        "the proxy to log the deleted pod's node removed",
        lambda: f"node removed: {old_url}" in env.log.read_text(errors="replace")[seen:],
        timeout=WAIT,
        interval=0.5,
    )
    env.wait_roles("the proxy to list the replacement", lambda got: got == env.expected())
    assert sorted(env.roles().values()) == ["decode", "prefill"]  # decode was scaled to 1 above


def _set_ready(env: Env, pod: str, ready: bool) -> None:
    """What a failing readiness probe does: the pod keeps running and its IP, Ready goes False
    (kwok leaves a pod's status alone once it has made it Ready)."""
    patch = {"status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}
    env.cluster.kubectl(
        "patch", "pod", pod, "-n", env.namespace, "--subresource=status", "-p", json.dumps(patch)
    )


def test_a_pod_that_stops_being_ready_is_dropped_and_returns(env: Env) -> None:
    decode = [p for p in env.pods(f"{engine_selector(NAME)},tandem.dev/role=decode") if _ready(p)]
    assert len(decode) == 1
    name, url = decode[0]["metadata"]["name"], _url(decode[0])
    assert env.roles()[url] == "decode"
    _set_ready(env, name, False)
    env.wait_roles("the unready pod's node to be dropped", lambda got: url not in got)
    pod = env.cluster.kubectl_json("get", "pod", name, "-n", env.namespace)
    assert pod["status"]["phase"] == "Running" and pod["status"]["podIP"] and not _ready(pod)
    assert env.roles() == env.expected() and sorted(env.roles().values()) == ["prefill"]
    _set_ready(env, name, True)
    env.wait_roles(
        "the node to come back when the pod is Ready again", lambda got: got.get(url) == "decode"
    )
    assert env.roles() == env.expected()


def test_a_pod_that_becomes_schedulable_and_ready_is_added(env: Env) -> None:
    """The Pending pod becomes a node once it can run: delete it, recreate it asking 1 GPU."""
    pod = env.cluster.kubectl_json("get", "pod", "too-big", "-n", env.namespace)
    env.cluster.kubectl(
        "delete", "pod", "too-big", "-n", env.namespace, "--wait=true", "--timeout=60s"
    )
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields"):
        pod["metadata"].pop(key, None)
    pod.pop("status", None)
    resources = pod["spec"]["containers"][0]["resources"]
    resources["limits"][GPU_RESOURCE] = resources["requests"][GPU_RESOURCE] = "1"
    _apply(env.cluster, [pod])
    env.wait_roles(
        "the formerly Pending pod to be a node",
        lambda got: (
            sorted(got.values()) == ["decode", "decode", "prefill"] and got == env.expected()
        ),
    )
