"""The InferenceService spec: the one source of its schema, its defaults and its rules.

Everything else is derived from these models: the CRD's structural schema and CEL rules
(``tandem.operator.crd``), the Helm chart's copy of the CRD, the plan (``plan.py``) that
both the operator and ``tandem up`` run. A rule is written once (:class:`Rule`) with its CEL
expression for the API server and a Python predicate for ``load_inference_service``, so a
spec that the cluster rejects is rejected locally with the same message.

Field names are camelCase in YAML (``maxModelLen``) and snake_case in Python
(``max_model_len``); ``spec.engine``'s names are exactly ``EngineConfig``'s fields, so each
maps onto the engine flag of the same name (``--max-model-len``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from .kubeschema import KubeSchema

GROUP = "tandem.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["tisvc"]
CATEGORIES = ["tandem"]
API_VERSION = f"{GROUP}/{VERSION}"

GPU_RESOURCE = "nvidia.com/gpu"
MODEL_URI_SCHEMES = ("hf://", "pvc://", "/")
NAME_MAX = 40  # children are named <name>-prefill, <name>-model-<hash>...: keep them DNS labels


@dataclass(frozen=True)
class Rule:
    """One validation rule, stated twice in one place: CEL for the API server, Python for us.

    ``cel`` becomes an ``x-kubernetes-validations`` entry on the model's schema; ``check``
    runs in the model's validator. Both report ``message``, so users see the same words
    from ``kubectl apply`` and from ``tandem up``. ``field`` points the CEL error at a field
    (``fieldPath``) when the rule is about one.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    field: str | None = None


class _Model(BaseModel):
    """camelCase in YAML, snake_case in Python; unknown fields are errors, not silently dropped."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> _Model:
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self


class ModelCache(_Model):
    """Where an ``hf://`` model is downloaded to: a PVC the operator creates, or an existing one."""

    claim_name: str | None = Field(
        None, description="Use this existing PVC as the cache instead of creating one"
    )
    size: str = Field("100Gi", description="Size of the cache PVC the operator creates")
    storage_class_name: str | None = Field(
        None, description="StorageClass of the cache PVC the operator creates"
    )
    access_modes: list[str] = Field(
        default_factory=lambda: ["ReadWriteMany"],
        description="Access modes of the cache PVC (engines on many nodes read it)",
    )
    retain: bool = Field(
        True,
        description="Keep the cache PVC when the InferenceService is deleted; a new one of the "
        "same name and model adopts it without downloading again",
    )


def _uri_ok(uri: str) -> bool:
    if uri.startswith("hf://"):
        return len([p for p in uri[5:].split("/") if p]) == 2
    if uri.startswith("pvc://"):
        return bool(uri[6:].split("/", 1)[0])
    return uri.startswith("/")


class ModelSpec(_Model):
    """The model to serve and where its weights come from."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=256,
        description="The model name clients send in 'model' (--served-model-name)",
    )
    uri: str = Field(
        ...,
        min_length=1,
        max_length=1024,
        description="hf://org/repo, pvc://claim/path, or an absolute path in the image",
    )
    revision: str | None = Field(
        None, description="Hugging Face revision (branch, tag or commit) for hf:// models"
    )
    credentials_secret: str | None = Field(
        None, description="Secret with key HF_TOKEN, used to download gated hf:// models"
    )
    cache: ModelCache | None = Field(
        None, description="Download cache for hf:// models (default: a new PVC)"
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.uri.startsWith('/') || self.uri.matches('^hf://[^/]+/[^/]+$')"
            " || self.uri.matches('^pvc://[^/]+(/.*)?$')",
            "model.uri must be hf://org/repo, pvc://claim/path or an absolute path",
            lambda m: _uri_ok(m.uri),
            field=".uri",
        ),
        Rule(
            "self.uri.startsWith('hf://') || (!has(self.revision) && !has(self.cache)"
            " && !has(self.credentialsSecret))",
            "model.revision, model.cache and model.credentialsSecret apply only to hf:// models",
            lambda m: (
                m.uri.startswith("hf://")
                or (m.revision is None and m.cache is None and m.credentials_secret is None)
            ),
        ),
    )


class EngineSpec(_Model):
    """Engine settings shared by every engine role. Names are ``EngineConfig``'s fields.

    Unset fields keep the engine's own default, so the CRD does not freeze defaults that
    belong to the engine. ``tensorParallelSize`` is not here: it is each role's ``gpus``.
    """

    image: str | None = Field(
        None, description="Engine image (default: the operator's configured image)"
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Image pull policy"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights and activations dtype"
    )
    block_size: int | None = Field(
        None, ge=1, le=1024, description="KV cache block size in tokens (a power of two)"
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence (prompt + output) in tokens"
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of GPU memory the engine may use for weights and KV cache",
    )
    kv_cache_tokens: int | None = Field(
        None, ge=1, description="KV cache size in tokens (overrides gpuMemoryUtilization)"
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Most sequences in one batch")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Token budget of one engine step"
    )
    enable_prefix_caching: bool | None = Field(
        None, description="Reuse KV blocks of shared prefixes"
    )
    prefix_cache_scope: Literal["key", "global"] | None = Field(
        None,
        description="Whose cached prefixes a request may reuse: its own API key's (key, the "
        "default) or every key's (global)",
    )
    attention_backend: Literal["auto", "torch", "flashinfer"] | None = Field(
        None, description="Attention kernels"
    )
    enforce_eager: bool | None = Field(None, description="Disable CUDA graphs")
    seed: int | None = Field(None, description="Sampling seed for requests without their own")
    kv_lease_seconds: float | None = Field(
        None,
        gt=0,
        description="Seconds a prefill engine holds exported KV blocks for the decode engine to pull",
    )
    kv_pull_fallback: Literal["error", "recompute"] | None = Field(
        None,
        description="When a decode engine cannot pull the KV cache: fail the request, or recompute the prefill",
    )
    session_kv_fraction: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fraction of the KV cache idle sessions may hold; beyond it the least recently used give theirs back",
    )
    max_sessions_per_key: int | None = Field(
        None,
        ge=1,
        description="Sessions one client key keeps at once; past it that key's own least recently used idle session goes, never another key's",
    )
    pooling: Literal["last", "mean", "cls"] | None = Field(
        None,
        description="Embeddings and /pooling: the last token's hidden state, the mean, or the first (CLS)",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More 'tandem serve' flags, appended as given"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables for the engine containers"
    )
    shutdown_timeout_seconds: int = Field(
        30, ge=0, le=3600, description="Seconds running requests may take to finish after SIGTERM"
    )
    startup_timeout_seconds: int = Field(
        1800,
        ge=60,
        le=86400,
        description="Seconds a pod may take to load the model before it is restarted",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.blockSize) || [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024].exists(p, p == self.blockSize)",
            "engine.blockSize must be a power of two",
            lambda e: e.block_size is None or e.block_size & (e.block_size - 1) == 0,
            field=".blockSize",
        ),
        Rule(
            "!has(self.kvCacheTokens) || !has(self.blockSize) || self.kvCacheTokens >= self.blockSize",
            "engine.kvCacheTokens must hold at least one block",
            lambda e: (
                e.kv_cache_tokens is None
                or e.block_size is None
                or e.kv_cache_tokens >= e.block_size
            ),
        ),
    )


AUTOSCALING_BACKENDS = ("HPA", "KEDA", "Planner")
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


class Autoscaling(_Model):
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


class SloSpec(_Model):
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


class Resources(_Model):
    """Container resources as Kubernetes quantities; the GPU limit comes from ``gpus``."""

    requests: dict[str, str] = Field(default_factory=dict, description="Resource requests")
    limits: dict[str, str] = Field(default_factory=dict, description="Resource limits")


def _gpu_limit_agrees(role: RoleSpec) -> bool:
    given = role.resources.limits.get(GPU_RESOURCE) if role.resources else None
    return given is None or given.strip() == str(role.gpus)


class PodTemplateMeta(_Model):
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations")


class PodTemplateOverride(_Model):
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


class PodTemplate(_Model):
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


class RoleSpec(_Model):
    """One engine pool: how many replicas, each with how many GPUs, scheduled where."""

    replicas: int | None = Field(
        None, ge=0, description="Replicas (default 1); exclusive with autoscaling"
    )
    autoscaling: Autoscaling | None = Field(
        None, description="Scale between min and max on a metric"
    )
    gpus: int = Field(1, ge=0, le=64, description="GPUs per replica; the tensor-parallel size")
    tensor_parallel_size: int | None = Field(None, ge=1, description="If given, must equal gpus")
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
            "!has(self.tensorParallelSize) || self.tensorParallelSize == self.gpus",
            "tensorParallelSize must equal gpus (one tensor-parallel rank per GPU)",
            lambda r: r.tensor_parallel_size is None or r.tensor_parallel_size == r.gpus,
            field=".tensorParallelSize",
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


class ServiceSpec(_Model):
    """The proxy's Service: the OpenAI endpoint."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="Service type"
    )
    port: int = Field(8000, ge=1, le=65535, description="Service port")
    annotations: dict[str, str] = Field(default_factory=dict, description="Service annotations")


class SecretKeyRef(_Model):
    name: str = Field(..., min_length=1, description="Secret name")
    key: str = Field("api-key", description="Key in the Secret")


class ProxySpec(_Model):
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


class InferenceServiceSpec(_Model):
    """``spec`` of an InferenceService."""

    model: ModelSpec = Field(..., description="The model and where its weights come from")
    mode: Literal["Disaggregated", "Aggregated"] = Field(
        "Disaggregated",
        description="Disaggregated: prefill and decode pools; Aggregated: one pool of 'both' engines",
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self == oldSelf", "message": "mode is immutable"}
            ]
        },
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="Engine settings for every role"
    )
    prefill: RoleSpec | None = Field(
        None, description="Prefill pool (Disaggregated only; default 1 replica)"
    )
    decode: RoleSpec = Field(
        default_factory=RoleSpec,
        description="Decode pool; in Aggregated mode the pool that serves everything",
    )
    proxy: ProxySpec = Field(default_factory=ProxySpec, description="The proxy and its Service")
    slo: SloSpec | None = Field(
        None, description="Latency targets the planner sizes prefill and decode for"
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.mode != 'Aggregated' || !has(self.prefill)",
            "Aggregated mode has no prefill role",
            lambda s: s.mode != "Aggregated" or s.prefill is None,
            field=".prefill",
        ),
        Rule(
            "!has(self.slo) || (self.mode == 'Disaggregated' && has(self.prefill)"
            " && has(self.prefill.autoscaling) && self.prefill.autoscaling.backend == 'Planner'"
            " && has(self.decode.autoscaling) && self.decode.autoscaling.backend == 'Planner')",
            "slo needs mode Disaggregated and prefill.autoscaling and decode.autoscaling with "
            "backend Planner (their min/max bound the planner)",
            lambda s: s.slo is None or _planned(s, both=True),
            field=".slo",
        ),
        Rule(
            "has(self.slo) || ((!has(self.prefill) || !has(self.prefill.autoscaling)"
            " || self.prefill.autoscaling.backend != 'Planner') && (!has(self.decode.autoscaling)"
            " || self.decode.autoscaling.backend != 'Planner'))",
            "autoscaling backend Planner needs spec.slo",
            lambda s: s.slo is not None or not _planned(s, both=False),
        ),
    )


def _planned(spec: InferenceServiceSpec, both: bool) -> bool:
    """Whether both (or any) of prefill and decode are autoscaled by the planner."""
    roles = [spec.prefill, spec.decode] if spec.mode == "Disaggregated" else [spec.decode]
    flags = [
        r is not None and r.autoscaling is not None and r.autoscaling.backend == "Planner"
        for r in roles
    ]
    return (all(flags) and len(flags) == 2) if both else any(flags)


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RoleStatus(_Model):
    desired: int = 0
    ready: int = 0
    updated: int = 0
    available: int = 0
    replicas: str = Field("0/0", description="ready/desired, for printing")


class InferenceServiceStatus(_Model):
    """``status``: recomputed from the children; never carries the operator's bookkeeping."""

    observed_generation: int | None = None
    phase: Literal["Pending", "Downloading", "Progressing", "Ready", "Degraded"] | None = None
    url: str | None = None
    selector: str | None = None
    decode_selector: str | None = Field(
        None, description="Label selector of the decode pods (the scale subresource's)"
    )
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    proxy: RoleStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)


class ObjectMeta(BaseModel):
    """The parts of metadata the plan uses; the rest is kept as given."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(
        ..., min_length=1, max_length=NAME_MAX, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
    )
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceService(BaseModel):
    """A whole InferenceService object: apiVersion, kind, metadata, spec (status ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    api_version: Literal["tandem.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["InferenceService"] = KIND
    metadata: ObjectMeta
    spec: InferenceServiceSpec


def load_inference_service(data: dict[str, Any] | str) -> InferenceService:
    """Parse (YAML text or a dict), validate and default an InferenceService.

    Raises ``ValueError`` whose message names each offending field by its YAML path
    (``spec.prefill.replicas: ...``), so a user can find it without reading a traceback.
    """
    if isinstance(data, str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise ValueError(f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(
            "an InferenceService must be a mapping with apiVersion, kind, metadata and spec"
        )
    try:
        return InferenceService.model_validate(data)
    except ValidationError as exc:
        raise ValueError(format_errors(exc)) from None


def format_errors(exc: ValidationError) -> str:
    """One line per error: the field's YAML path, then pydantic's message (our rule messages verbatim)."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(root)"
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}")
    return "invalid InferenceService: " + "; ".join(lines)
