"""The whole InferenceService: its API identity, ``spec``, metadata, and the one loader."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .autoscaling import SloSpec
from .engine import EngineSpec
from .gateway import GatewaySpec
from .model import LoraSpec, ModelSpec, lora_on_model_claim
from .proxy import ProxySpec
from .roles import RoleSpec
from .rules import Rule, SpecModel

GROUP = "tandem.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["tisvc"]
CATEGORIES = ["tandem"]
API_VERSION = f"{GROUP}/{VERSION}"

LORAS_MAX = 64  # bounds the CEL rules' cost over spec.loras
NAME_MAX = 40  # children are named <name>-prefill, <name>-model-<hash>...: keep them DNS labels
# What the API server accepts as any object's name (a DNS-1123 subdomain); children's names
# are derived from it as DNS-1035 labels (render.meta.child_base).
DNS_1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class InferenceServiceSpec(SpecModel):
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
    loras: list[LoraSpec] = Field(
        default_factory=list,
        max_length=LORAS_MAX,
        # the API server keeps names distinct, and server-side apply merges by name
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="LoRA adapters every engine serves (needs engine.enableLora); adding or "
        "removing one hot-loads or unloads it on the running engines, no pod restarts",
    )
    prefill: RoleSpec | None = Field(
        None, description="Prefill pool (Disaggregated only; default 1 replica)"
    )
    decode: RoleSpec = Field(
        default_factory=RoleSpec,
        description="Decode pool; in Aggregated mode the pool that serves everything",
    )
    proxy: ProxySpec = Field(
        default_factory=ProxySpec,
        description="The front door: the proxy and its Service, or with router gateway the "
        "endpoint picker (replicas, resources, routingPolicy, extraArgs; apiKeySecret goes "
        "to the engines, which take clients directly)",
    )
    router: Literal["proxy", "gateway"] = Field(
        "proxy",
        description="proxy: Tandem's proxy is the OpenAI endpoint; gateway: a Gateway API "
        "Inference Extension gateway routes to the engines, asking an InferencePool's "
        "endpoint picker (tandem epp)",
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self == oldSelf", "message": "router is immutable"}
            ]
        },
    )
    gateway: GatewaySpec = Field(
        default_factory=GatewaySpec, description="The gateway's objects (router gateway only)"
    )
    slo: SloSpec | None = Field(
        None, description="Latency targets the planner sizes prefill and decode for"
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.loras) || size(self.loras) == 0 || (has(self.engine)"
            " && has(self.engine.enableLora) && self.engine.enableLora)",
            "loras need engine.enableLora (the engines start with LoRA on, then load and "
            "unload adapters as spec.loras changes)",
            lambda s: not s.loras or s.engine.enable_lora is True,
            field=".loras",
        ),
        Rule(
            "!has(self.loras) || self.loras.all(a, a.name != self.model.name"
            " && a.name != 'default')",
            "loras names must be distinct and differ from model.name and 'default'",
            lambda s: _lora_names_ok(s),
            field=".loras",
        ),
        Rule(
            "!has(self.loras) || self.loras.all(a, !a.uri.startsWith('pvc://')"
            " || (self.model.uri.startsWith('pvc://') && (self.model.uri + '/')"
            ".startsWith(a.uri.substring(0, a.uri.indexOf('/', 6) + 1))))",
            "loras[].uri pvc://claim/path must be on the model's own claim (another claim "
            "would be a new volume, which restarts the engines)",
            lambda s: all(lora_on_model_claim(a.uri, s.model.uri) for a in s.loras),
            field=".loras",
        ),
        Rule(
            "self.router != 'gateway' || (has(self.proxy) && has(self.proxy.apiKeySecret))",
            "router gateway needs proxy.apiKeySecret: behind a gateway the engines take "
            "clients directly and check their key",
            lambda s: s.router != "gateway" or s.proxy.api_key_secret is not None,
            field=".router",
        ),
        Rule(
            "!has(self.gateway) || !has(self.gateway.httpRoute) || self.router == 'gateway'",
            "gateway.httpRoute needs router gateway",
            lambda s: s.gateway.http_route is None or s.router == "gateway",
            field=".gateway",
        ),
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


def _lora_names_ok(spec: InferenceServiceSpec) -> bool:
    names = [a.name for a in spec.loras]
    return len(set(names)) == len(names) and not {spec.model.name, "default"} & set(names)


def _planned(spec: InferenceServiceSpec, both: bool) -> bool:
    """Whether both (or any) of prefill and decode are autoscaled by the planner."""
    roles = [spec.prefill, spec.decode] if spec.mode == "Disaggregated" else [spec.decode]
    flags = [
        r is not None and r.autoscaling is not None and r.autoscaling.backend == "Planner"
        for r in roles
    ]
    return (all(flags) and len(flags) == 2) if both else any(flags)


class ObjectMeta(BaseModel):
    """The parts of metadata the plan uses; the rest is kept as given."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(..., min_length=1, max_length=NAME_MAX, pattern=DNS_1123_SUBDOMAIN)
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
