"""Every child of an InferenceService, in an order that applies cleanly. Pure."""

from __future__ import annotations

from ..autoscaler.objects import autoscaler_objects
from ..spec.inference_service import InferenceService
from ..topology import Topology, plan
from .engines import engine_deployment, engine_service, pod_group
from .gateway import gateway_objects
from .leader_worker_set import engine_leader_worker_set, group_worker_network_policy
from .loras import lora_config_map
from .meta import Manifest, object_meta, pool_name
from .model import model_objects
from .options import RenderOptions
from .pods import pod_disruption_budget
from .proxy import proxy_objects
from .security import network_policy


def render(
    isvc: InferenceService,
    options: RenderOptions = RenderOptions(),
    topology: Topology | None = None,
) -> list[Manifest]:
    """Every child object of an InferenceService, in an order that applies cleanly."""
    topology = topology or plan(isvc)
    out = model_objects(isvc, topology, options)
    out.append(network_policy(isvc, topology))
    if any(role.nodes > 1 for role in topology.engines):
        out.append(group_worker_network_policy(isvc, topology))
    if topology.lora_config:  # before the engines, which mount it
        out.append(lora_config_map(isvc, topology))
    if options.gang_scheduling and topology.mode == "Disaggregated":
        out.append(pod_group(isvc, topology))
    for role in topology.roles:
        if not role.is_engine:
            front = gateway_objects if topology.router == "gateway" else proxy_objects
            out += front(isvc, topology, role, options)
            continue
        out.append(engine_service(isvc, topology, role))
        out.append(pod_disruption_budget(isvc, topology, role))
        out += autoscaler_objects(
            role.autoscaling,
            object_meta(isvc, topology, pool_name(topology, role), "engine", role.role),
            pool_name(topology, role),
            role.role,
            role.autoscaling.metric if role.autoscaling else "",
        )
        if options.model_ready or topology.model.kind != "hf":
            workload = engine_leader_worker_set if role.nodes > 1 else engine_deployment
            out.append(workload(isvc, topology, role, options))
    return out
