"""hf:// models: the cache claim the weights are downloaded into, the download Job, and the
volumes through which every engine reads the weights. Pure."""

from __future__ import annotations

from typing import Any

from ..spec.inference_service import InferenceService
from ..topology import MODEL_CACHE_MOUNT, MODEL_PVC_MOUNT, Topology
from .meta import (
    MODEL_CACHED_ANNOTATION,
    Manifest,
    cache_claim_name,
    cached_model_key,
    download_job_name,
    labels,
    object_meta,
)
from .options import RenderOptions
from .pods import container_resources, container_security, pod_security

DOWNLOAD_SCRIPT = (
    "import os, sys\n"
    "from huggingface_hub import snapshot_download\n"
    "repo, revision, target = sys.argv[1:4]\n"
    "if os.path.exists(os.path.join(target, '.tandem-complete')): sys.exit(0)\n"
    "snapshot_download(repo_id=repo, revision=revision, local_dir=target, token=os.environ.get('HF_TOKEN'))\n"
    "open(os.path.join(target, '.tandem-complete'), 'w').close()\n"
)


def model_volumes(
    isvc: InferenceService, topology: Topology
) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) that put the weights at the path the engines load (``--model``)."""
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


def model_objects(
    isvc: InferenceService, topology: Topology, options: RenderOptions
) -> list[Manifest]:
    """For hf:// models: the cache PVC (unless an existing one is named) and the download Job."""
    if topology.model.kind != "hf":
        return []
    out: list[Manifest] = []
    cache = isvc.spec.model.cache
    if not (cache and cache.claim_name):
        out.append(cache_claim(isvc, topology, options))
    if not options.model_cached:
        out.append(download_job(isvc, topology, options))
    return out


def cache_claim(isvc: InferenceService, topology: Topology, options: RenderOptions) -> Manifest:
    """The cache PVC the operator creates; annotated with the model once it holds it."""
    cache = isvc.spec.model.cache
    retain = cache.retain if cache else True
    meta = object_meta(isvc, topology, cache_claim_name(isvc), "model-cache")
    if retain:  # no owner: the garbage collector leaves it when the service goes
        meta.pop("ownerReferences", None)  # rendered without a uid (--render) it has none
    if options.model_ready:
        meta["annotations"] = {MODEL_CACHED_ANNOTATION: cached_model_key(topology)}
    pvc_spec: dict[str, Any] = {
        "accessModes": list(cache.access_modes if cache else ["ReadWriteMany"]),
        "resources": {"requests": {"storage": cache.size if cache else "100Gi"}},
    }
    if cache and cache.storage_class_name:
        pvc_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta,
        "spec": pvc_spec,
    }


def download_job(isvc: InferenceService, topology: Topology, options: RenderOptions) -> Manifest:
    """The Job that ``snapshot_download``s the model into the cache claim (once: a marker
    file makes a rerun a no-op)."""
    source = topology.model
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
        "resources": container_resources(None, 0, "download"),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_CACHE_MOUNT}],
        "securityContext": container_security(),
    }
    claim = cache_claim_name(isvc)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_meta(isvc, topology, download_job_name(topology), "model-download"),
        "spec": {
            "backoffLimit": 6,
            "template": {
                "metadata": {"labels": labels(topology, "model-download")},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "containers": [container],
                    "securityContext": pod_security(),
                    "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": claim}}],
                },
            },
        },
    }
