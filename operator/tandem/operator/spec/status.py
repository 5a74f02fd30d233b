"""``status``: the schema of what the operator reports; ``tandem.operator.status`` computes it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .rules import SpecModel


class Condition(SpecModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RoleStatus(SpecModel):
    desired: int = 0
    ready: int = 0
    updated: int = 0
    available: int = 0
    replicas: str = Field("0/0", description="ready/desired, for printing")


class LoraStatus(SpecModel):
    """One adapter of ``spec.loras`` as the engines are given it."""

    name: str
    uri: str
    path: str = Field(description="Where the engines read it (in their --lora-config file)")


class InferenceServiceStatus(SpecModel):
    """``status``: recomputed from the children; never carries the operator's bookkeeping."""

    observed_generation: int | None = None
    phase: Literal["Pending", "Downloading", "Progressing", "Ready", "Idle", "Degraded"] | None = (
        None
    )
    url: str | None = None
    selector: str | None = None
    decode_selector: str | None = Field(
        None, description="Label selector of the decode pods (the scale subresource's)"
    )
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    proxy: RoleStatus | None = None
    loras: list[LoraStatus] = Field(
        default_factory=list,
        description="spec.loras as written into the engines' adapters ConfigMap (NAME-loras), "
        "which every running engine loads within a kubelet sync and a 2 s poll",
    )
    conditions: list[Condition] = Field(default_factory=list)
