"""``spec.<role>.autoscaling`` and ``spec.slo``: who sets a pool's replicas, and for what
latency."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .rules import Rule, SpecModel

AUTOSCALING_BACKENDS = ("HPA", "KEDA", "Planner")
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


class Autoscaling(SpecModel):
    """Who sets a role's replicas: an HPA, a KEDA ScaledObject, or the operator's SLO planner.

    The operator then never writes that role's replicas in the Deployment it applies.
    """

    backend: Literal["HPA", "KEDA", "Planner"] = Field(
        "HPA",
        description="HPA: a HorizontalPodAutoscaler on a custom metric; KEDA: a ScaledObject "
        "with a Prometheus trigger on the same metric (and scale to zero); Planner: the "
        "operator sizes prefill and decode together from spec.slo",
    )
    min_replicas: int = Field(
        1, ge=0, description="Fewest replicas; 0 (KEDA or Planner) scales the pool to zero"
    )
    max_replicas: int = Field(..., ge=1, description="Most replicas")
    prometheus_address: str = Field(
        DEFAULT_PROMETHEUS, description="Prometheus that KEDA's trigger queries (backend KEDA)"
    )
    metric: str = Field(
        "tandem_num_requests_waiting",
        description="Per-pod custom metric the autoscaler averages: the engine's "
        "tandem:num_requests_waiting as a metrics adapter (e.g. prometheus-adapter) "
        "names it",
    )
    target_average_value: str = Field("4", description="Target per-pod average of the metric")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must not exceed maxReplicas",
            lambda a: a.min_replicas <= a.max_replicas,
        ),
        Rule(
            "self.minReplicas > 0 || self.backend != 'HPA'",
            "autoscaling.minReplicas 0 needs backend KEDA or Planner (an HPA cannot scale to zero)",
            lambda a: a.min_replicas > 0 or a.backend != "HPA",
            field=".minReplicas",
        ),
    )


class SloSpec(SpecModel):
    """The latency a Disaggregated service promises; the planner sizes both pools to keep it."""

    ttft_ms: float = Field(..., gt=0, description="Time to first token target, milliseconds")
    itl_ms: float = Field(
        ..., gt=0, description="Mean inter-token latency target per request, milliseconds"
    )
    attainment: float = Field(
        0.99, ge=0.5, lt=1, description="Fraction of requests that must meet both targets"
    )
    surge: float = Field(
        0.75,
        ge=0,
        le=10,
        description="Rise of the request rate, relative to the current rate, that the running "
        "pools absorb at the SLO limit while a new replica starts (0.75: the load may grow by "
        "three quarters within one engine start-up)",
    )
    profile_config_map: str = Field(
        ...,
        min_length=1,
        description="ConfigMap whose key profile.json holds the engine's performance profile "
        "(bench/ measures it)",
    )
