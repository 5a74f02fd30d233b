"""Topology -> Kubernetes manifests. Pure: the same spec always renders the same objects.

Every object carries the ``app.kubernetes.io/*`` and ``tandem.dev/*`` labels and, when the
InferenceService has a uid, a controller owner reference to it, so deleting the
InferenceService lets the garbage collector remove everything rendered here. Fields that
another controller owns are left out on purpose: an autoscaled role's Deployment has no
``replicas`` (its HPA, ScaledObject or the planner writes it), so server-side apply never fights it.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from .autoscaler.objects import autoscaler_objects
from .spec.inference_service import API_VERSION, KIND, InferenceService
from .spec.roles import GPU_RESOURCE, PodTemplate, Resources
from .topology import (
    COMPONENT_LABEL,
    ENGINE_SELECTOR_LABEL,
    MODEL_CACHE_MOUNT,
    MODEL_PVC_MOUNT,
    RolePlan,
    Topology,
    plan,
)

DEFAULT_IMAGE = "ghcr.io/tandem-dev/tandem:0.1.0"
ROLE_LABEL = "tandem.dev/role"
MODEL_ANNOTATION = "tandem.dev/served-model-name"
KV_LAYOUT_LABEL = "tandem.dev/kv-layout"
MODEL_CACHED_ANNOTATION = "tandem.dev/cached-model"
MANAGER = "tandem-operator"
PRESTOP_SECONDS = 5  # let the proxy and EndpointSlices drop the pod before SIGTERM
GRACE_MARGIN_SECONDS = 10
STARTUP_PERIOD_SECONDS = 10
INTERNAL_KEY = "internal-api-key"  # the key in the internal-credential Secret
METRICS_SCRAPER_LABEL = "tandem.dev/metrics-scraper"

Manifest = dict[str, Any]

# Requests when a role's resources leave them unset: pods are Burstable, not BestEffort, so
# the scheduler reserves room for the weights' host copy and the tokenizer threads.
DEFAULT_REQUESTS = {
    "engine": {"cpu": "2", "memory": "8Gi"},
    "proxy": {"cpu": "250m", "memory": "256Mi"},
    "download": {"cpu": "500m", "memory": "1Gi"},
}

DOWNLOAD_SCRIPT = (
    "import os, sys\n"
    "from huggingface_hub import snapshot_download\n"
    "repo, revision, target = sys.argv[1:4]\n"
    "if os.path.exists(os.path.join(target, '.tandem-complete')): sys.exit(0)\n"
    "snapshot_download(repo_id=repo, revision=revision, local_dir=target, token=os.environ.get('HF_TOKEN'))\n"
    "open(os.path.join(target, '.tandem-complete'), 'w').close()\n"
)


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide settings (from Helm values), not per InferenceService."""

    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    model_ready: bool = True
    """False while an hf:// download Job has not succeeded: engines are not rendered yet."""
    model_cached: bool = False
    """The cache claim already holds the model (a retained cache): no download Job."""
    gang_scheduling: bool = False
    """Admit a Disaggregated service's engines as a gang (Kubernetes' PodGroup API)."""


def labels(topology: Topology, component: str, role: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": topology.name,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/part-of": "tandem",
        "app.kubernetes.io/managed-by": MANAGER,
        ENGINE_SELECTOR_LABEL: topology.name,
    }
    if role:
        out[ROLE_LABEL] = role
    return out


def selector_labels(topology: Topology, role: str) -> dict[str, str]:
    """Immutable in a Deployment, so only labels that never change for a pool."""
    return {ENGINE_SELECTOR_LABEL: topology.name, ROLE_LABEL: role}


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": isvc.metadata.name,
        "uid": isvc.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pool_name(topology: Topology, role: RolePlan) -> str:
    return f"{topology.name}-{role.name}"


def proxy_service_name(topology: Topology) -> str:
    return topology.name


def download_job_name(topology: Topology) -> str:
    digest = hashlib.sha256(
        f"{topology.model.repo_id}@{topology.model.revision}".encode()
    ).hexdigest()[:8]
    return f"{topology.name}-download-{digest}"


def cache_claim_name(isvc: InferenceService) -> str:
    cache = isvc.spec.model.cache
    return cache.claim_name if cache and cache.claim_name else f"{isvc.metadata.name}-model-cache"


def cached_model_key(topology: Topology) -> str:
    """What the cache claim's annotation says once the model is downloaded into it."""
    return f"{topology.model.repo_id}@{topology.model.revision}"


def service_url(isvc: InferenceService) -> str:
    """The in-cluster OpenAI endpoint."""
    port = isvc.spec.proxy.service.port
    return f"http://{isvc.metadata.name}.{isvc.metadata.namespace}.svc.cluster.local:{port}/v1"


def _meta(
    isvc: InferenceService, topology: Topology, name: str, component: str, role: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": topology.namespace,
        "labels": labels(topology, component, role),
    }
    if isvc.metadata.uid:
        meta["ownerReferences"] = [owner_reference(isvc)]
    return meta


def _resources(resources: Resources | None, gpus: int, kind: str) -> dict[str, Any]:
    requests = {**DEFAULT_REQUESTS[kind], **(resources.requests if resources else {})}
    limits = dict(resources.limits) if resources else {}
    if gpus > 0:
        limits[GPU_RESOURCE] = str(gpus)
        requests[GPU_RESOURCE] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def scrape_annotations(port: int) -> dict[str, str]:
    """The ``prometheus.io/*`` pod annotations that annotation-based scrape configs follow
    (where no Prometheus Operator runs; its PodMonitor, from the chart, ignores them)."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def _env(env: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def _model_volumes(
    isvc: InferenceService, topology: Topology
) -> tuple[list[Manifest], list[Manifest]]:
    source = topology.model
    if source.kind == "hf":
        return (
            [
                {
                    "name": "model",
                    "persistentVolumeClaim": {
                        "claimName": cache_claim_name(isvc),
                        "readOnly": True,
                    },
                }
            ],
            [{"name": "model", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True}],
        )
    if source.kind == "pvc":
        return (
            [
                {
                    "name": "model",
                    "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True},
                }
            ],
            [{"name": "model", "mountPath": MODEL_PVC_MOUNT, "readOnly": True}],
        )
    return [], []


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def internal_secret_name(topology: Topology) -> str:
    return f"{topology.name}-internal"


def internal_credential_secret(isvc: InferenceService, topology: Topology, token: str) -> Manifest:
    """The credential the proxy and the engines share (``docs/security.md``). Rendered from a
    token the operator generates once: it is created when absent and never re-applied, so
    running pods and new ones always agree."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(isvc, topology, internal_secret_name(topology), "credentials"),
        "type": "Opaque",
        "stringData": {INTERNAL_KEY: token},
    }


def internal_credential_env(topology: Topology) -> dict[str, Any]:
    """The internal credential as an environment variable from its Secret (never an argument)."""
    return {
        "name": "TANDEM_INTERNAL_API_KEY",
        "valueFrom": {
            "secretKeyRef": {"name": internal_secret_name(topology), "key": INTERNAL_KEY}
        },
    }


def network_policy(isvc: InferenceService, topology: Topology) -> Manifest:
    """Engine pods accept traffic (HTTP and the KV transport) only from this InferenceService's
    own pods (its proxy and peer engines), plus pods labelled ``tandem.dev/metrics-scraper``
    (any namespace) on the HTTP port for /metrics. Kubelet probes are not subject to it."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isvc, topology, f"{topology.name}-engines", "engine"),
        "spec": {
            "podSelector": {
                "matchLabels": {ENGINE_SELECTOR_LABEL: topology.name, COMPONENT_LABEL: "engine"}
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": {ENGINE_SELECTOR_LABEL: topology.name}}}
                    ]
                },
                {
                    "from": [
                        {
                            "namespaceSelector": {},
                            "podSelector": {"matchLabels": {METRICS_SCRAPER_LABEL: "true"}},
                        }
                    ],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                },
            ],
        },
    }


def engine_deployment(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> Manifest:
    """Engine pods: GPUs, probes sized for slow loads, a drain on termination."""
    assert role.spec is not None
    engine = isvc.spec.engine
    name = pool_name(topology, role)
    volumes, mounts = _model_volumes(isvc, topology)
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})  # NCCL between TP ranks
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    grace = engine.shutdown_timeout_seconds + PRESTOP_SECONDS + GRACE_MARGIN_SECONDS
    container: dict[str, Any] = {
        "name": "engine",
        "image": engine.image or options.image,
        "imagePullPolicy": engine.image_pull_policy or options.image_pull_policy,
        "args": [*role.args, "--host", "0.0.0.0", "--port", str(role.port)],
        "ports": [{"name": "http", "containerPort": role.port, "protocol": "TCP"}],
        "env": [*_env(role.env), internal_credential_env(topology)],
        "resources": _resources(role.spec.resources, role.gpus, "engine"),
        # Loading weights can take many minutes: the startup probe allows startupTimeoutSeconds
        # before liveness starts counting; readiness is "the model is being served".
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "failureThreshold": math.ceil(engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS),
            "timeoutSeconds": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        # /health is 503 while asleep or draining, which is not dead: liveness checks the socket.
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
            "timeoutSeconds": 5,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
        "securityContext": _pod_security(),
        "enableServiceLinks": False,
    }
    rs = role.spec
    if rs.node_selector:
        pod_spec["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in rs.tolerations]
    if rs.affinity:
        pod_spec["affinity"] = dict(rs.affinity)
    if rs.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [dict(t) for t in rs.topology_spread_constraints]
    if rs.priority_class_name:
        pod_spec["priorityClassName"] = rs.priority_class_name
    template = {
        "metadata": {
            "labels": {
                **labels(topology, "engine", role.role),
                KV_LAYOUT_LABEL: topology.kv_layout,
            },
            # the proxy's discovery reads the model name from here
            "annotations": {
                MODEL_ANNOTATION: topology.served_model_name,
                **scrape_annotations(role.port),
            },
        },
        "spec": pod_spec,
    }
    if options.gang_scheduling and topology.mode == "Disaggregated":
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group_name(topology)}
    if rs.pod_template:
        template = merge_pod_template(template, rs.pod_template)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(topology, role.role)},
        # Surge first so capacity never drops during a roll (it waits for a free GPU slot).
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "progressDeadlineSeconds": engine.startup_timeout_seconds + 300,
        "template": template,
    }
    if role.autoscaling is None:
        spec["replicas"] = role.replicas  # an autoscaled role's replicas belong to its autoscaler
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(isvc, topology, name, "engine", role.role),
        "spec": spec,
    }


GANG_MIN_COUNT = 2
"""One prefill and one decode pod: the smallest set that serves. PodGroup's minCount is
immutable, so it cannot follow the replica counts without renaming the group (and so
rolling every pod) on each scale; pods added later to an admitted group schedule alone."""


def pod_group_name(topology: Topology) -> str:
    return f"{topology.name}-engines"


def pod_group(isvc: InferenceService, topology: Topology) -> Manifest:
    """Kubernetes' gang scheduling (scheduling.k8s.io/v1alpha2, alpha in 1.36): the scheduler
    binds none of the engine pods until a prefill and a decode pod can be bound together,
    so a half-scheduled service holds no GPU."""
    return {
        "apiVersion": "scheduling.k8s.io/v1alpha2",
        "kind": "PodGroup",
        "metadata": _meta(isvc, topology, pod_group_name(topology), "engine"),
        "spec": {"schedulingPolicy": {"gang": {"minCount": GANG_MIN_COUNT}}},
    }


def engine_service(isvc: InferenceService, topology: Topology, role: RolePlan) -> Manifest:
    """Headless: gives each engine pod a DNS name; the proxy addresses pods, not a VIP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(isvc, topology, pool_name(topology, role), "engine", role.role),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(topology, role.role),
            "ports": [{"name": "http", "port": role.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(isvc: InferenceService, topology: Topology, role: RolePlan) -> Manifest:
    component = "engine" if role.is_engine else "proxy"
    max_unavailable = role.spec.max_unavailable if role.spec else 1
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, topology, pool_name(topology, role), component, role.role),
        "spec": {
            "maxUnavailable": max_unavailable,
            "selector": {"matchLabels": selector_labels(topology, role.role)},
            # a crash-looping pod must not block draining its node
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def proxy_objects(
    isvc: InferenceService, topology: Topology, role: RolePlan, options: RenderOptions
) -> list[Manifest]:
    """The proxy Deployment, its Service (the OpenAI endpoint) and the RBAC its discovery needs."""
    name = pool_name(topology, role)
    proxy = isvc.spec.proxy
    args = [*role.args, "--host", "0.0.0.0", "--port", str(role.port)]
    env: list[dict[str, Any]] = [*_env(role.env), internal_credential_env(topology)]
    if proxy.api_key_secret:
        # read from the environment by the proxy: never an argument, which ps would show
        env.append(
            {
                "name": "TANDEM_PROXY_API_KEY",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": proxy.api_key_secret.name,
                        "key": proxy.api_key_secret.key,
                    }
                },
            }
        )
    container: dict[str, Any] = {
        "name": "proxy",
        "image": isvc.spec.engine.image or options.image,
        "imagePullPolicy": isvc.spec.engine.image_pull_policy or options.image_pull_policy,
        "args": args,
        "ports": [{"name": "http", "containerPort": role.port, "protocol": "TCP"}],
        "resources": _resources(proxy.resources, 0, "proxy"),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": _container_security(),
    }
    container["env"] = env
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(isvc, topology, name, "proxy", "proxy"),
        "spec": {
            "replicas": role.replicas,
            "selector": {"matchLabels": selector_labels(topology, "proxy")},
            "template": {
                "metadata": {
                    "labels": labels(topology, "proxy", "proxy"),
                    "annotations": scrape_annotations(role.port),
                },
                "spec": {
                    "serviceAccountName": name,
                    "containers": [container],
                    "securityContext": _pod_security(),
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": isvc.spec.engine.shutdown_timeout_seconds
                    + GRACE_MARGIN_SECONDS,
                },
            },
        },
    }
    service_meta = _meta(isvc, topology, proxy_service_name(topology), "proxy", "proxy")
    if proxy.service.annotations:
        service_meta["annotations"] = dict(proxy.service.annotations)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": service_meta,
        "spec": {
            "type": proxy.service.type,
            "selector": selector_labels(topology, "proxy"),
            "ports": [
                {
                    "name": "http",
                    "port": proxy.service.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(isvc, topology, name, "proxy", "proxy"),
    }
    rbac_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(isvc, topology, name, "proxy", "proxy"),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(isvc, topology, name, "proxy", "proxy"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": topology.namespace}],
    }
    return [
        account,
        rbac_role,
        binding,
        deployment,
        service,
        pod_disruption_budget(isvc, topology, role),
    ]


def model_objects(
    isvc: InferenceService, topology: Topology, options: RenderOptions
) -> list[Manifest]:
    """For hf:// models: the cache PVC (unless an existing one is named) and the download Job."""
    source = topology.model
    if source.kind != "hf":
        return []
    out: list[Manifest] = []
    cache = isvc.spec.model.cache
    claim = cache_claim_name(isvc)
    if not (cache and cache.claim_name):
        retain = cache.retain if cache else True
        meta = _meta(isvc, topology, claim, "model-cache")
        if retain:  # no owner: the garbage collector leaves it when the service goes
            del meta["ownerReferences"]
        if options.model_ready:
            meta["annotations"] = {MODEL_CACHED_ANNOTATION: cached_model_key(topology)}
        pvc_spec: dict[str, Any] = {
            "accessModes": list(cache.access_modes if cache else ["ReadWriteMany"]),
            "resources": {"requests": {"storage": cache.size if cache else "100Gi"}},
        }
        if cache and cache.storage_class_name:
            pvc_spec["storageClassName"] = cache.storage_class_name
        out.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": meta,
                "spec": pvc_spec,
            }
        )
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{MODEL_CACHE_MOUNT}/.hf"}]
    if isvc.spec.model.credentials_secret:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {"name": isvc.spec.model.credentials_secret, "key": "HF_TOKEN"}
                },
            }
        )
    container = {
        "name": "download",
        "image": isvc.spec.engine.image or options.image,
        "imagePullPolicy": isvc.spec.engine.image_pull_policy or options.image_pull_policy,
        "command": ["python", "-c", DOWNLOAD_SCRIPT, source.repo_id, source.revision, source.path],
        "env": env,
        "resources": _resources(None, 0, "download"),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_CACHE_MOUNT}],
        "securityContext": _container_security(),
    }
    if options.model_cached:
        return out
    job_meta = _meta(isvc, topology, download_job_name(topology), "model-download")
    out.append(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": job_meta,
            "spec": {
                "backoffLimit": 6,
                "template": {
                    "metadata": {"labels": labels(topology, "model-download")},
                    "spec": {
                        "restartPolicy": "OnFailure",
                        "containers": [container],
                        "securityContext": _pod_security(),
                        "volumes": [
                            {"name": "model", "persistentVolumeClaim": {"claimName": claim}}
                        ],
                    },
                },
            },
        }
    )
    return out


def render(
    isvc: InferenceService,
    options: RenderOptions = RenderOptions(),
    topology: Topology | None = None,
) -> list[Manifest]:
    """Every child object of an InferenceService, in an order that applies cleanly."""
    topology = topology or plan(isvc)
    out = model_objects(isvc, topology, options)
    out.append(network_policy(isvc, topology))
    if options.gang_scheduling and topology.mode == "Disaggregated":
        out.append(pod_group(isvc, topology))
    for role in topology.roles:
        if not role.is_engine:
            out += proxy_objects(isvc, topology, role, options)
            continue
        out.append(engine_service(isvc, topology, role))
        out.append(pod_disruption_budget(isvc, topology, role))
        out += autoscaler_objects(
            role.autoscaling,
            _meta(isvc, topology, pool_name(topology, role), "engine", role.role),
            pool_name(topology, role),
            role.role,
            role.autoscaling.metric if role.autoscaling else "",
        )
        if options.model_ready or topology.model.kind != "hf":
            out.append(engine_deployment(isvc, topology, role, options))
    return out


# Strategic-merge keys of the pod fields a podTemplate may set (Kubernetes' patchMergeKey).
MERGE_KEYS = {"containers": "name", "volumes": "name", "volumeMounts": "mountPath", "env": "name"}


def _merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Kubernetes' strategic merge of ``patch`` into ``base`` for the keys in MERGE_KEYS:
    maps merge, keyed lists merge item by item, other lists and scalars replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    merge_key = MERGE_KEYS.get(key or "")
    if merge_key and isinstance(base, list) and isinstance(patch, list):
        out_list = [dict(item) for item in base]
        index = {item.get(merge_key): i for i, item in enumerate(out_list)}
        for item in patch:
            at = index.get(item.get(merge_key))
            if at is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[at] = _merge(out_list[at], item)
        return out_list
    return copy.deepcopy(patch)


def merge_pod_template(template: Manifest, override: PodTemplate) -> Manifest:
    """A role's ``podTemplate`` merged into its rendered pod template. The rendered labels
    the selectors and the proxy depend on win over an override of the same key."""
    patch = {
        "metadata": override.metadata.model_dump(by_alias=True),
        "spec": override.spec.model_dump(by_alias=True, exclude_none=True),
    }
    patch["metadata"] = {k: v for k, v in patch["metadata"].items() if v}
    patch["spec"] = {k: v for k, v in patch["spec"].items() if v}
    merged = _merge(template, patch)
    merged["metadata"]["labels"] = {
        **override.metadata.labels,
        **template["metadata"]["labels"],
    }
    return merged
