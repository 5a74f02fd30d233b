"""``spec.gateway``: the Gateway API Inference Extension objects when ``spec.router`` is
``gateway`` (``docs/gateway.md``): the InferencePool's endpoint picker and, when asked, an
HTTPRoute from an existing Gateway to the pool."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .rules import SpecModel


class ParentRef(SpecModel):
    """A Gateway the HTTPRoute attaches to (Gateway API's ``parentRefs`` entry)."""

    name: str = Field(..., min_length=1, description="The Gateway's name")
    namespace: str | None = Field(None, description="The Gateway's namespace (default: this one)")
    section_name: str | None = Field(None, description="One listener of the Gateway")


class HTTPRouteSpec(SpecModel):
    """An HTTPRoute sending the Gateway's traffic to this InferenceService's InferencePool."""

    parent_refs: list[ParentRef] = Field(
        ..., min_length=1, max_length=8, description="The Gateways to attach to"
    )
    hostnames: list[str] = Field(
        default_factory=list, max_length=16, description="Host names to match (default: any)"
    )


class GatewaySpec(SpecModel):
    """What ``router: gateway`` renders besides the InferencePool and its picker."""

    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        "FailClose",
        description="What the gateway does when the endpoint picker does not answer: refuse "
        "(FailClose) or pick an engine itself (FailOpen)",
    )
    http_route: HTTPRouteSpec | None = Field(
        None, description="Render an HTTPRoute from these Gateways to the InferencePool"
    )
