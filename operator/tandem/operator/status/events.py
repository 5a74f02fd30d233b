"""Which status changes become Kubernetes Events. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..spec.status import InferenceServiceStatus
from .conditions import FAILURES


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    condition: str
    status: str


def events(old: InferenceServiceStatus | None, new: InferenceServiceStatus) -> list[Event]:
    """One event per condition whose status or reason changed: resyncs that change nothing
    post nothing. A failure reason is a Warning."""
    before = {c.type: (c.status, c.reason) for c in old.conditions} if old else {}
    out = []
    for c in new.conditions:
        if before.get(c.type) == (c.status, c.reason):
            continue
        if c.type == "Degraded" and c.status == "False" and c.type not in before:
            continue  # "no failures" on creation says nothing
        kind: Literal["Normal", "Warning"] = "Warning" if c.reason in FAILURES else "Normal"
        out.append(Event(kind, c.reason, f"{c.type}={c.status}: {c.message}", c.type, c.status))
    return out
