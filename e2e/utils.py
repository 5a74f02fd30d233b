"""Helpers for the e2e tests: InferenceService bodies, kubectl reads, and ``tandem operator``
as a subprocess under the chart's ServiceAccount."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import Cluster, wait_for

ROOT = Path(__file__).resolve().parents[1]
RELEASE, RELEASE_NS = "tandem", "tandem-system"
PEERING = "tandem-e2e"
STARTED = "tandem.operator: started"  # the line the operator logs once it is connected


def _isvc(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "tiny", "uri": "/opt/models/tiny"}, **spec}
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def _apply(
    cluster: Cluster, obj: dict[str, Any], check: bool = True, *extra: str
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", *extra, "-f", "-", input=json.dumps(obj), check=check)


def _account_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    """The admin kubeconfig's cluster with ``account``'s token: a process run with it may
    do what that ServiceAccount's Role allows, nothing more."""
    token = cluster.kubectl(
        "create", "token", account, "-n", namespace, "--duration=1h"
    ).stdout.strip()
    entry = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [entry],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [
                    {
                        "name": account,
                        "context": {
                            "cluster": entry["name"],
                            "user": account,
                            "namespace": namespace,
                        },
                    }
                ],
                "current-context": account,
            }
        )
    )
    return path


def _get(cluster: Cluster, kind: str, name: str, namespace: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", kind, name, "-n", namespace)


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(
        (c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {}
    )


def _table(cluster: Cluster, namespace: str, name: str, *flags: str) -> dict[str, str]:
    """`kubectl get tisvc NAME` as {column: cell}, cut at the header's column starts."""
    header, row = cluster.kubectl(
        "get", "tisvc", name, "-n", namespace, *flags
    ).stdout.splitlines()[:2]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = [*starts, len(row) + 1]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(bounds, bounds[1:], strict=False)}


def _events(
    cluster: Cluster, namespace: str, name: str, reason: str | None = None
) -> list[dict[str, Any]]:
    """The Events on an InferenceService (with this reason), as `kubectl get events` lists them."""
    items = cluster.kubectl_json(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.kind=InferenceService,involvedObject.name={name}",
    )["items"]
    return [e for e in items if reason is None or e.get("reason") == reason]


def _patch_engine(
    cluster: Cluster, namespace: str, name: str, engine: dict[str, Any], generation: int
) -> None:
    """Change ``spec.engine`` and wait until the operator has observed that generation."""
    cluster.kubectl(
        "patch",
        "tisvc",
        name,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"engine": engine}}),
    )
    wait_for(
        f"observedGeneration {generation}",
        lambda: (
            _get(cluster, "tisvc", name, namespace)["status"].get("observedGeneration")
            == generation
        ),
        timeout=60,
        interval=1,
    )


def _children(cluster: Cluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    kinds = "deployments,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets"
    items = cluster.kubectl_json(
        "get",
        kinds,
        "-n",
        namespace,
        "-l",
        f"tandem.dev/inferenceservice={name}",
        "--show-managed-fields",
    )["items"]
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in items}


class Operator:
    """``tandem operator`` as a subprocess under the chart's ServiceAccount."""

    def __init__(self, cluster: Cluster, workdir: Path, *extra: str) -> None:
        self.cluster = cluster
        self.extra = extra
        self.log = workdir / "operator.log"
        self.kubeconfig = workdir / "operator.kubeconfig"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def write_kubeconfig(self) -> None:
        token = self.cluster.kubectl(
            "create", "token", RELEASE, "-n", RELEASE_NS, "--duration=2h"
        ).stdout.strip()
        admin = yaml.safe_load(self.cluster.kubeconfig.read_text())
        cluster_entry = admin["clusters"][0]
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [cluster_entry],
                    "users": [{"name": "operator", "user": {"token": token}}],
                    "contexts": [
                        {
                            "name": "operator",
                            "context": {"cluster": cluster_entry["name"], "user": "operator"},
                        }
                    ],
                    "current-context": "operator",
                }
            )
        )

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KUBECONFIG", None)
        with self.log.open("a") as log:
            log.write(f"\n===== start {self.starts} =====\n")
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem.server.cli",
                    "operator",
                    "--kubeconfig",
                    str(self.kubeconfig),
                    "--peering",
                    PEERING,
                    "--liveness",
                    "",
                    "--resync-seconds",
                    "30",
                    "--image",
                    "tandem:e2e",
                    "--gang-scheduling",  # the harness enables Kubernetes' PodGroup API
                    *self.extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        wait_for(
            "the operator to start",
            lambda: not self.running() or STARTED in self.output_since_start(),
            timeout=60,
        )
        assert self.running(), self.tail()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM: kopf leaves the peering on a graceful stop, so a successor leads at once."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def output_since_start(self) -> str:
        text = self.log.read_text()
        return text[text.rfind(f"===== start {self.starts} =====") :]

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])


def running_operator(op: Operator) -> Iterator[Operator]:
    """Start ``op`` under the chart's ServiceAccount; stop it (and show its log) after."""
    op.write_kubeconfig()
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"\n[e2e] operator log tail:\n{op.tail(15)}", file=sys.stderr)


def _wait_ready(
    cluster: Cluster, op: Operator, namespace: str, name: str, timeout: float = 90
) -> dict[str, Any]:
    def ready() -> bool:
        return _condition(_get(cluster, "tisvc", name, namespace), "Ready").get("status") == "True"

    try:
        wait_for(f"{namespace}/{name} to be Ready", ready, timeout=timeout, interval=1)
    except TimeoutError:
        print(
            json.dumps(_get(cluster, "tisvc", name, namespace).get("status"), indent=1),
            file=sys.stderr,
        )
        print(op.tail(), file=sys.stderr)
        raise
    return _get(cluster, "tisvc", name, namespace)


def _wait_condition(
    cluster: Cluster, op: Operator, namespace: str, name: str, type_: str, reason: str
) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def has() -> bool:
        seen.append(_get(cluster, "tisvc", name, namespace))
        return _condition(seen[-1], type_).get("reason") == reason

    try:
        wait_for(f"{name} {type_} reason {reason}", has, timeout=60, interval=1)
    except TimeoutError:
        print(json.dumps(seen[-1].get("status"), indent=1), op.tail())
        raise
    return seen[-1]


class Watch:
    """``kubectl get --watch`` in the background: every version of the objects, in the order
    the API server sent them, so a test can check an invariant at each event rather than
    poll (and miss a short violation)."""

    def __init__(self, cluster: Cluster, path: Path, *args: str) -> None:
        self.cluster, self.path, self.args = cluster, path, args
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Watch:
        with self.path.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(self.cluster.bin_dir / "kubectl"),
                    "get",
                    *self.args,
                    "--watch",
                    "--output-watch-events",
                    "-o",
                    "json",
                ],
                stdout=out,
                stderr=subprocess.DEVNULL,
                env=self.cluster.tool_env(),
            )
        return self

    def __exit__(self, *_: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def events(self) -> list[dict[str, Any]]:
        """The watch events so far: ``{"type": ADDED|MODIFIED|DELETED, "object": ...}``."""
        text, decoder, out, at = self.path.read_text(), json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at >= len(text):
                return out
            try:
                event, at = decoder.raw_decode(text, at)
            except ValueError:
                return out  # the last event is still being written
            out.append(event)


def _filler(namespace: str, replicas: int, gpus: int = 1) -> dict[str, Any]:
    """Pods of ``gpus`` GPUs each, to leave exactly the GPUs a test wants free."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "filler", "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "filler"}},
            "template": {
                "metadata": {"labels": {"app": "filler"}},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "f",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                        }
                    ]
                },
            },
        },
    }


def _quota(namespace: str, name: str, hard: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"hard": hard},
    }
