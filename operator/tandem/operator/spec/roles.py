"""``spec.prefill`` and ``spec.decode``: one engine pool's size, GPUs, scheduling and pod
overrides."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field

from ..kubeschema import KubeSchema
from .autoscaling import Autoscaling
from .rules import Rule, SpecModel

GPU_RESOURCE = "nvidia.com/gpu"


class Resources(SpecModel):
    """Container resources as Kubernetes quantities; the GPU limit comes from ``gpus``."""

    requests: dict[str, str] = Field(default_factory=dict, description="Resource requests")
    limits: dict[str, str] = Field(default_factory=dict, description="Resource limits")


def _gpu_limit_agrees(role: RoleSpec) -> bool:
    given = role.resources.limits.get(GPU_RESOURCE) if role.resources else None
    return given is None or given.strip() == str(role.gpus)


class PodTemplateMeta(SpecModel):
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations")


class PodTemplateOverride(SpecModel):
    """Pod fields merged into the rendered pod as a strategic merge patch would: a container
    named like the rendered one (``engine``) merges into it (its ``volumeMounts`` and ``env``
    by name), other containers are sidecars; ``volumes`` merge by name; scalars replace."""

    containers: Annotated[list[dict[str, Any]], KubeSchema("V1Container", list_of=True)] = Field(
        default_factory=list, description="Sidecars, or 'engine' to merge into the engine"
    )
    volumes: Annotated[list[dict[str, Any]], KubeSchema("V1Volume", list_of=True)] = Field(
        default_factory=list, description="Extra volumes"
    )
    scheduler_name: str | None = Field(None, description="Scheduler for the pods")
    priority_class_name: str | None = Field(None, description="Pod priority class")
    runtime_class_name: str | None = Field(None, description="RuntimeClass (e.g. nvidia)")
    service_account_name: str | None = Field(None, description="ServiceAccount of the pods")


class PodTemplate(SpecModel):
    """Per-role overrides of the rendered pod template."""

    metadata: PodTemplateMeta = Field(
        default_factory=PodTemplateMeta, description="Extra labels and annotations"
    )
    spec: PodTemplateOverride = Field(
        default_factory=PodTemplateOverride, description="Pod spec fields merged in"
    )


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


POWERS_OF_TWO_64 = "[1, 2, 4, 8, 16, 32, 64]"
NODES_PER_REPLICA_KIND = (
    "nodesPerReplica cannot change between 1 and more than 1: the pool would change kind "
    "(Deployment, LeaderWorkerSet); create a new InferenceService"
)


class RoleSpec(SpecModel):
    """One engine pool: how many replicas, each with how many GPUs, scheduled where."""

    replicas: int | None = Field(
        None, ge=0, description="Replicas (default 1); exclusive with autoscaling"
    )
    autoscaling: Autoscaling | None = Field(
        None, description="Scale between min and max on a metric"
    )
    gpus: int = Field(
        1,
        ge=0,
        le=64,
        description="GPUs per pod; the tensor-parallel size is gpus x nodesPerReplica",
    )
    nodes_per_replica: int = Field(
        1,
        ge=1,
        le=64,
        description="Pods (nodes) one replica spans: above 1, each replica is a "
        "LeaderWorkerSet group of this many pods, each with gpus GPUs, running one engine",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(self == 1) == (oldSelf == 1)",
                    "message": NODES_PER_REPLICA_KIND,
                }
            ]
        },
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="If given, must equal gpus x nodesPerReplica"
    )
    resources: Resources | None = Field(
        None, description="CPU, memory and other resources per replica"
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods require"
    )
    tolerations: Annotated[list[dict[str, Any]], KubeSchema("V1Toleration", list_of=True)] = Field(
        default_factory=list, description="Pod tolerations"
    )
    affinity: Annotated[dict[str, Any] | None, KubeSchema("V1Affinity")] = Field(
        None, description="Pod affinity"
    )
    topology_spread_constraints: Annotated[
        list[dict[str, Any]], KubeSchema("V1TopologySpreadConstraint", list_of=True)
    ] = Field(default_factory=list, description="Pod topology spread constraints")
    priority_class_name: str | None = Field(None, description="Pod priority class")
    pod_template: PodTemplate | None = Field(
        None, description="Labels, annotations, volumes, sidecars... merged into the pods"
    )
    max_unavailable: int = Field(
        1, ge=0, description="Pods a voluntary disruption may take at once (PodDisruptionBudget)"
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!(has(self.replicas) && has(self.autoscaling))",
            "replicas and autoscaling are mutually exclusive",
            lambda r: not (r.replicas is not None and r.autoscaling is not None),
        ),
        Rule(
            f"!has(self.gpus) || self.gpus == 0 || {POWERS_OF_TWO_64}.exists(p, p == self.gpus)",
            "gpus (the tensorParallelSize) must be 0 or a power of two",
            lambda r: r.gpus == 0 or _power_of_two(r.gpus),
            field=".gpus",
        ),
        Rule(
            "!has(self.tensorParallelSize) || self.tensorParallelSize == self.gpus"
            " * (has(self.nodesPerReplica) ? self.nodesPerReplica : 1)",
            "tensorParallelSize must equal gpus (one tensor-parallel rank per GPU) times "
            "nodesPerReplica",
            lambda r: (
                r.tensor_parallel_size is None
                or r.tensor_parallel_size == r.gpus * r.nodes_per_replica
            ),
            field=".tensorParallelSize",
        ),
        Rule(
            "!has(self.nodesPerReplica) || self.nodesPerReplica == 1 || !has(self.autoscaling)",
            "autoscaling a role with nodesPerReplica > 1 is not supported yet: set replicas",
            lambda r: r.nodes_per_replica == 1 or r.autoscaling is None,
        ),
        Rule(
            "!has(self.resources) || !has(self.resources.limits) || !('nvidia.com/gpu' in self.resources.limits)"
            " || self.resources.limits['nvidia.com/gpu'] == string(self.gpus)",
            "resources.limits['nvidia.com/gpu'] must equal gpus",
            _gpu_limit_agrees,
        ),
    )

    def desired_replicas(self) -> int:
        """The replica count to start with: explicit, else the autoscaler's minimum, else 1."""
        if self.replicas is not None:
            return self.replicas
        return self.autoscaling.min_replicas if self.autoscaling else 1
