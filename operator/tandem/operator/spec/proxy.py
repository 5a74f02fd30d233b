"""``spec.proxy``: the OpenAI front door and its Service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .roles import Resources
from .rules import SpecModel


class ServiceSpec(SpecModel):
    """The proxy's Service: the OpenAI endpoint."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="Service type"
    )
    port: int = Field(8000, ge=1, le=65535, description="Service port")
    annotations: dict[str, str] = Field(default_factory=dict, description="Service annotations")


class SecretKeyRef(SpecModel):
    name: str = Field(..., min_length=1, description="Secret name")
    key: str = Field("api-key", description="Key in the Secret")


class ProxySpec(SpecModel):
    """The OpenAI front door: picks engines per request and runs the P/D flow."""

    replicas: int = Field(1, ge=0, description="Proxy replicas")
    routing_policy: Literal["score", "least_load", "round_robin"] | None = Field(
        None, description="How the proxy picks engines (default: the proxy's, score)"
    )
    api_key_secret: SecretKeyRef | None = Field(
        None, description="Require this API key from clients"
    )
    service: ServiceSpec = Field(default_factory=ServiceSpec, description="The endpoint's Service")
    resources: Resources | None = Field(None, description="Proxy container resources")
    extra_args: list[str] = Field(default_factory=list, description="More 'tandem proxy' flags")
