"""A status refresh under load: kopf's copy of the InferenceService can predate the
operator's own last status write (its watch lags at 1,000 services). The refresh compares
with what it wrote, so it neither writes the same status again nor moves a condition's
lastTransitionTime later (which is how the Ready lag after the last pod grew with the count)."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.operator.indexes import INDEXES
from tandem.operator.reconcile import refresh_status
from tandem.operator.state import OperatorOptions, OperatorState

from .utils import UID, dep, ready_pods

KEY = ("ml", "svc")


class RecordingKube:
    """The API calls a refresh makes, recorded (the e2e tests run them on a real API server)."""

    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.events: list[str] = []

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    def post_event(self, involved: dict[str, Any], type_: str, reason: str, *_: Any) -> None:
        self.events.append(reason)


def _body(uid: str = UID) -> dict[str, Any]:
    """As created: no status yet (what kopf hands over until it sees the first write)."""
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ml", "uid": uid, "generation": 1},
        "spec": {
            "mode": "Aggregated",
            "model": {"name": "tiny", "uri": "/models/tiny"},
            "decode": {"replicas": 1, "gpus": 0},
            "proxy": {"replicas": 1},
        },
        "status": {},
    }


def _indexes(ready: bool) -> dict[str, Any]:
    indexes: dict[str, Any] = {name: {} for name in INDEXES}
    n = int(ready)
    indexes["child_deployments"] = {KEY: [dep("both", 1, n), dep("proxy", 1, n)]}
    indexes["child_pods"] = {KEY: ready_pods("both", n) + ready_pods("proxy", n)}
    return indexes


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_a_refresh_with_a_stale_body_writes_nothing_new() -> None:
    state = OperatorState(OperatorOptions())
    kube = state.kube = RecordingKube()  # type: ignore[assignment]

    async def refreshes() -> None:
        await refresh_status(state, KEY, _body(), _indexes(ready=False))
        await refresh_status(state, KEY, _body(), _indexes(ready=True))
        for _ in range(3):  # child events while the body still has no status
            await refresh_status(state, KEY, _body(), _indexes(ready=True))

    asyncio.run(refreshes())
    assert len(kube.statuses) == 2, "one write per change, none per stale body"
    assert _ready(kube.statuses[0])["status"] == "False"
    assert _ready(kube.statuses[1])["status"] == "True"
    assert kube.events.count("AllRolesReady") == 1


def test_a_recreated_namesake_does_not_inherit_the_status_written_for_the_old_one() -> None:
    state = OperatorState(OperatorOptions())
    kube = state.kube = RecordingKube()  # type: ignore[assignment]

    async def refreshes() -> None:
        await refresh_status(state, KEY, _body(), _indexes(ready=True))
        # deleted and created again before the operator forgot the old one
        await refresh_status(state, KEY, _body(uid="another-uid"), _indexes(ready=True))

    asyncio.run(refreshes())
    assert len(kube.statuses) == 2, "the new object's first refresh writes its status"
