"""Which status changes become Kubernetes Events. Pure.

One Event per cause, not per condition that carries it: a quota refusal shows on
``DecodeReady``, ``Ready``, ``Degraded`` and ``RolloutComplete`` at once, and is posted once
(a Warning, from the most specific of them). Besides failures, only ``Ready`` turning True
or False is posted (Normal): a rollout's steps and resyncs post nothing, so a service
created and becoming Ready posts one Event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..spec.status import Condition, InferenceServiceStatus
from .conditions import FAILURES

# Conditions that name a cause less precisely than a pool's, the model's or an autoscaler's.
GENERAL = ("Ready", "RolloutComplete", "Degraded", "Progressing")


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    condition: str
    status: str


def _specific_first(c: Condition) -> int:
    return GENERAL.index(c.type) + 1 if c.type in GENERAL else 0


def events(old: InferenceServiceStatus | None, new: InferenceServiceStatus) -> list[Event]:
    """A Warning for each failure reason that no condition had before, and a Normal Event
    when ``Ready`` changes status for a reason that is no failure. Resyncs post nothing."""
    before = {c.type: (c.status, c.reason) for c in old.conditions} if old else {}
    causes = {reason for _, reason in before.values() if reason in FAILURES}
    out = []
    for c in sorted(new.conditions, key=_specific_first):
        if before.get(c.type) == (c.status, c.reason):
            continue
        message = f"{c.type}={c.status}: {c.message}"
        if c.reason in FAILURES:
            if c.reason not in causes:
                causes.add(c.reason)
                out.append(Event("Warning", c.reason, message, c.type, c.status))
        elif c.type == "Ready" and (before.get("Ready", ("False", ""))[0] != c.status):
            out.append(Event("Normal", c.reason, message, c.type, c.status))
    return out
