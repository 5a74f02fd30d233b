"""Leader election among operator replicas: kopf's peering object, and each replica's priority."""

from __future__ import annotations

import random
import time

from .kube import Kube, KubeError


def leader_priority(now: float | None = None) -> int:
    """kopf freezes all operators of equal priority, and pauses the lower ones: make the
    oldest replica the highest (it keeps leading through a rolling update), with a random
    tie-breaker for replicas started in the same second."""
    started = int(time.time() if now is None else now)
    return (2**40 - started) * 1000 + random.randrange(1000)


def ensure_peering(kube: Kube, name: str, namespaces: tuple[str, ...]) -> None:
    """kopf needs its peering object to exist; create it (idempotently) rather than make
    every installation do it by hand. A CR cannot ship in the chart beside its own CRD."""
    if namespaces:
        targets = [
            (
                f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings",
                {
                    "apiVersion": "kopf.dev/v1",
                    "kind": "KopfPeering",
                    "metadata": {"name": name, "namespace": ns},
                },
            )
            for ns in namespaces
        ]
    else:
        targets = [
            (
                "/apis/kopf.dev/v1/clusterkopfpeerings",
                {
                    "apiVersion": "kopf.dev/v1",
                    "kind": "ClusterKopfPeering",
                    "metadata": {"name": name},
                },
            )
        ]
    for path, body in targets:
        try:
            kube.request("POST", path, body)
        except KubeError as exc:
            if exc.status != 409:  # 409: it exists already
                raise
