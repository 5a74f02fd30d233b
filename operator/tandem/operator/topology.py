"""Spec -> topology: which programs run, how many, with which arguments. Pure.

The operator renders a topology into Kubernetes objects (``tandem.operator.render``);
``tandem up`` runs the same topology as local processes. Keeping this step free of Kubernetes
and of I/O is what lets the two agree: an InferenceService YAML means the same engines
either way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal

from .spec.autoscaling import Autoscaling
from .spec.inference_service import InferenceService
from .spec.roles import RoleSpec

ENGINE_PORT = 8000
PROXY_PORT = 8000
PICKER_PORT = 9002  # the endpoint picker's gRPC port (GIE's default)
MODEL_CACHE_MOUNT = "/models/cache"
MODEL_PVC_MOUNT = "/models/pvc"
LORA_CONFIG_MOUNT = "/etc/tandem/loras"  # the adapters' ConfigMap, a directory volume
LORA_CONFIG_KEY = "loras.json"
ENGINE_SELECTOR_LABEL = "tandem.dev/inferenceservice"
COMPONENT_LABEL = "app.kubernetes.io/component"

# EngineSpec fields that are not EngineConfig fields (Kubernetes- or process-level settings).
# Every other EngineSpec field is an EngineConfig field and becomes the flag of that name.
NON_ENGINE_FIELDS = frozenset(
    {
        "image",
        "image_pull_policy",
        "extra_args",
        "env",
        "shutdown_timeout_seconds",
        "startup_timeout_seconds",
    }
)

RoleName = Literal["prefill", "decode", "both", "proxy"]


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are and the path the engine loads them from (``--model``)."""

    kind: Literal["hf", "pvc", "image"]
    path: str
    repo_id: str | None = None
    revision: str | None = None
    claim_name: str | None = None
    sub_path: str | None = None


@dataclass(frozen=True)
class RolePlan:
    """One program pool: ``args`` is the ``tandem`` argv after the program name, without
    ``--host``/``--port`` (the caller picks those; ``port`` is the in-cluster default)."""

    role: RoleName
    name: str
    replicas: int
    args: list[str]
    gpus: int
    env: dict[str, str]
    port: int
    autoscaling: Autoscaling | None = None
    spec: RoleSpec | None = None
    nodes: int = 1
    """Pods one replica spans (``nodesPerReplica``): above 1, a LeaderWorkerSet group."""

    @property
    def is_engine(self) -> bool:
        return self.role != "proxy"


@dataclass(frozen=True)
class Topology:
    name: str
    namespace: str
    mode: Literal["Disaggregated", "Aggregated"]
    served_model_name: str
    model: ModelSource
    engine_selector: str
    roles: list[RolePlan] = field(default_factory=list)
    kv_layout: str = ""
    """Hash of the settings that decide the KV cache's layout (see :func:`kv_layout`)."""
    router: Literal["proxy", "gateway"] = "proxy"
    """The front door: Tandem's proxy, or a GIE gateway asking the endpoint picker."""
    lora_config: str | None = None
    """The file every engine keeps its adapters served from (``--lora-config``), with
    ``engine.enableLora``; None without."""
    loras: tuple[tuple[str, str], ...] = ()
    """``spec.loras`` as (name, path in the engine), what ``lora_config`` holds."""

    def role(self, role: RoleName) -> RolePlan | None:
        return next((r for r in self.roles if r.role == role), None)

    @property
    def engines(self) -> list[RolePlan]:
        return [r for r in self.roles if r.is_engine]


def model_source(isvc: InferenceService) -> ModelSource:
    """Map the model URI onto a path inside the engine container."""
    model = isvc.spec.model
    uri = model.uri
    if uri.startswith("hf://"):
        repo_id = uri[len("hf://") :].strip("/")
        revision = model.revision or "main"
        return ModelSource(
            "hf", f"{MODEL_CACHE_MOUNT}/{repo_id}/{revision}", repo_id=repo_id, revision=revision
        )
    if uri.startswith("pvc://"):
        claim, _, sub_path = uri[len("pvc://") :].partition("/")
        sub_path = sub_path.strip("/")
        path = f"{MODEL_PVC_MOUNT}/{sub_path}" if sub_path else MODEL_PVC_MOUNT
        return ModelSource("pvc", path, claim_name=claim, sub_path=sub_path or None)
    return ModelSource("image", uri)


def lora_paths(isvc: InferenceService) -> tuple[tuple[str, str], ...]:
    """``spec.loras`` as (name, path in the engine): an absolute path as is, ``pvc://`` (on
    the model's claim, the spec's rule) under the claim's mount."""
    out = []
    for lora in isvc.spec.loras:
        path = lora.uri
        if path.startswith("pvc://"):
            path = f"{MODEL_PVC_MOUNT}/{path[len('pvc://') :].partition('/')[2].strip('/')}"
        out.append((lora.name, path))
    return tuple(out)


def engine_flags(isvc: InferenceService) -> list[str]:
    """``spec.engine`` as ``tandem serve`` flags: ``maxModelLen: 4096`` -> ``--max-model-len 4096``.

    Derived from the field names, so a field added to both EngineConfig and EngineSpec
    needs no change here; unset fields are left out and keep the engine's default.
    """
    flags: list[str] = []
    engine = isvc.spec.engine
    for name in type(engine).model_fields:
        if name in NON_ENGINE_FIELDS:
            continue
        value = getattr(engine, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)] if value else []
        else:
            flags += [flag, str(value)]
    return flags


# EngineSpec fields that change what a KV block holds or how it is laid out: a prefill engine
# and a decode engine can hand KV blocks over only when these agree.
KV_LAYOUT_FIELDS = ("dtype", "block_size")


def kv_layout(isvc: InferenceService) -> str:
    """A short hash of the model and the KV-layout settings. Every engine carries it (a pod
    label); the proxy pairs a prefill engine only with a decode engine of the same hash, so
    a rollout that changes the layout never pairs an old prefill with a new decode."""
    spec = isvc.spec
    settings = {
        "uri": spec.model.uri,
        "revision": spec.model.revision,
        **{f: getattr(spec.engine, f) for f in KV_LAYOUT_FIELDS},
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def lora_config_path(isvc: InferenceService) -> str | None:
    """The file in every engine pod that lists ``spec.loras`` (the ConfigMap's key in its
    volume), with ``engine.enableLora``: the flag and the mount never depend on the adapters
    themselves, so changing them changes no pod template."""
    return f"{LORA_CONFIG_MOUNT}/{LORA_CONFIG_KEY}" if isvc.spec.engine.enable_lora else None


def engine_selector(name: str) -> str:
    """The label selector of an InferenceService's engine pods (what the proxy discovers)."""
    return f"{ENGINE_SELECTOR_LABEL}={name},{COMPONENT_LABEL}=engine"


def plan(
    isvc: InferenceService,
    model_dir: str | None = None,
    discovery: Literal["kubernetes", "static"] = "kubernetes",
) -> Topology:
    """The topology of one InferenceService.

    ``model_dir`` replaces the in-container model path (``tandem up`` passes the local
    directory it downloaded or was given); ``discovery`` chooses how the proxy finds
    engines: the Kubernetes API in a cluster, or nodes the local runner registers.
    """
    spec = isvc.spec
    name, namespace = isvc.metadata.name, isvc.metadata.namespace
    source = model_source(isvc)
    model_path = model_dir or source.path
    roles: list[RolePlan] = []
    if spec.mode == "Disaggregated":
        roles.append(
            engine_role(isvc, "prefill", "prefill", spec.prefill or RoleSpec(), model_path)
        )
        roles.append(engine_role(isvc, "decode", "decode", spec.decode, model_path))
    else:
        roles.append(engine_role(isvc, "both", "engine", spec.decode, model_path))
    selector = engine_selector(name)
    # A local run (static discovery) has no gateway: its front door is always the proxy.
    router = spec.router if discovery == "kubernetes" else "proxy"
    front = picker_role(isvc, selector) if router == "gateway" else None
    roles.append(front or proxy_role(isvc, selector, discovery))
    return Topology(
        name=name,
        namespace=namespace,
        mode=spec.mode,
        served_model_name=spec.model.name,
        model=source,
        engine_selector=selector,
        roles=roles,
        kv_layout=kv_layout(isvc),
        router=router,
        lora_config=lora_config_path(isvc),
        loras=lora_paths(isvc),
    )


def engine_role(
    isvc: InferenceService, role: RoleName, pool: str, role_spec: RoleSpec, model_path: str
) -> RolePlan:
    """One engine pool: ``tandem serve`` with the model, the role, one rank per GPU (of
    every pod of a multi-node replica), and ``spec.engine`` as flags."""
    spec = isvc.spec
    args = [
        "serve",
        "--model",
        model_path,
        "--served-model-name",
        spec.model.name,
        "--role",
        role,
        "--tensor-parallel-size",
        str(max(1, role_spec.gpus) * role_spec.nodes_per_replica),
        "--shutdown-timeout",
        str(spec.engine.shutdown_timeout_seconds),
        *engine_flags(isvc),
        *(["--lora-config", path] if (path := lora_config_path(isvc)) else []),
        *spec.engine.extra_args,
    ]
    return RolePlan(
        role=role,
        name=pool,
        replicas=role_spec.desired_replicas(),
        args=args,
        gpus=role_spec.gpus,
        env=dict(spec.engine.env),
        port=ENGINE_PORT,
        autoscaling=role_spec.autoscaling,
        spec=role_spec,
        nodes=role_spec.nodes_per_replica,
    )


def proxy_role(
    isvc: InferenceService, selector: str, discovery: Literal["kubernetes", "static"]
) -> RolePlan:
    """The proxy pool: ``tandem proxy`` finding the engines by ``selector`` in a cluster."""
    return _front_door(isvc, "proxy", "proxy", PROXY_PORT, selector, discovery)


def picker_role(isvc: InferenceService, selector: str) -> RolePlan:
    """The front door behind a GIE gateway: ``tandem epp`` finding the engines by
    ``selector``, as the proxy would (role ``proxy``: it is the pool's front door, and its
    readiness is the InferenceService's ``ProxyReady``)."""
    pool = ("--pool-name", isvc.metadata.name)  # the InferencePool's selector and port rule
    return _front_door(isvc, "epp", "epp", PICKER_PORT, selector, "kubernetes", pool)


def _front_door(
    isvc: InferenceService,
    program: str,
    name: str,
    port: int,
    selector: str,
    discovery: Literal["kubernetes", "static"],
    extra: tuple[str, ...] = (),
) -> RolePlan:
    """A front door's pool (``spec.proxy``'s replicas, policy and extra flags): ``tandem
    <program>`` discovering the engines by ``selector`` in a cluster."""
    proxy = isvc.spec.proxy
    args = [program]
    if discovery == "kubernetes":
        args += [
            "--discovery",
            "kubernetes",
            "--namespace",
            isvc.metadata.namespace,
            "--selector",
            selector,
            *extra,
        ]
    if proxy.routing_policy:
        args += ["--routing-policy", proxy.routing_policy]
    args += proxy.extra_args
    return RolePlan(
        role="proxy",
        name=name,
        replicas=proxy.replicas,
        args=args,
        gpus=0,
        env={},
        port=port,
    )
