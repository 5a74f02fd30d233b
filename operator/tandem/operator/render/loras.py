"""``spec.loras``: a ConfigMap of its own that every engine pod mounts as a directory.

The adapters are not in the pod template: a Deployment's template hash would change with
them and roll every engine. The ConfigMap is mounted whole (no ``subPath``, which the
kubelet never updates), so a change reaches the running pods' volume within the kubelet's
sync period, and each engine's ``--lora-config`` watcher loads and unloads adapters from
it (``tandem.server.api.lora_config``). Pure.
"""

from __future__ import annotations

import json

from ..spec.inference_service import InferenceService
from ..topology import LORA_CONFIG_KEY, LORA_CONFIG_MOUNT, Topology
from .meta import Manifest, lora_config_map_name, object_meta

VOLUME = "loras"


def lora_config_data(topology: Topology) -> str:
    """The file the engines read: ``[{"name", "path"}]`` (vLLM's ``--lora-modules`` JSON)."""
    return json.dumps([{"name": n, "path": p} for n, p in topology.loras])


def lora_config_map(isvc: InferenceService, topology: Topology) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(isvc, topology, lora_config_map_name(topology), "engine"),
        "data": {LORA_CONFIG_KEY: lora_config_data(topology)},
    }


def lora_volume(topology: Topology) -> tuple[Manifest, Manifest]:
    """(volume, mount) of the ConfigMap, a read-only directory at ``LORA_CONFIG_MOUNT``."""
    return (
        {"name": VOLUME, "configMap": {"name": lora_config_map_name(topology)}},
        {"name": VOLUME, "mountPath": LORA_CONFIG_MOUNT, "readOnly": True},
    )
