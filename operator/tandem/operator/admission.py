"""Gang admission with ``schedulingGates`` (GA since Kubernetes 1.30): no alpha API. Pure.

Engine pods that ask for GPUs are created gated (``tandem.dev/gang-admission``): the
scheduler leaves them alone, so they hold no GPU. The operator removes the gate only when the
pods can be placed together in the free GPUs it sees (each node's allocatable minus the
requests of the pods bound to it or about to be). The gang is every gated pod of a KV layout
that has no admitted pod yet: a new service's prefill and decode, or a layout-changing
rollout's new pair, are admitted together or not at all, so a 70B service whose decode cannot
be placed never parks its prefill on 8 GPUs. Pods joining an admitted layout (a scale-up, a
same-layout rollout's surge) are admitted one by one as they fit.

It counts GPUs only: node selectors, taints and affinities are left to the scheduler, so an
admitted pod can still wait for it (then shown as the scheduler says).
"""

from __future__ import annotations

from dataclasses import dataclass

from .render.meta import ADMISSION_GATE
from .spec.roles import GPU_RESOURCE
from .status.children import PodSummary


@dataclass(frozen=True)
class GpuPod:
    """A pod anywhere in the cluster that asks for GPUs (what the ``gpu_pods`` index keeps)."""

    node: str | None
    gpus: int
    gated: bool


@dataclass(frozen=True)
class Admission:
    admit: tuple[str, ...] = ()
    """Pods whose gate to remove now."""
    held: str | None = None
    """What stays gated and why, for the status; None when nothing waits."""


def free_gpus(nodes: dict[str, int], pods: list[GpuPod]) -> list[int]:
    """Free GPUs per node, after the pods bound to each and those ungated but not yet bound
    (placed first-fit, largest first, where the scheduler would most likely put them)."""
    free = dict(nodes)
    pending = []
    for pod in pods:
        if pod.node is not None:
            free[pod.node] = free.get(pod.node, 0) - pod.gpus
        elif not pod.gated:
            pending.append(pod.gpus)
    slots = sorted(free.values(), reverse=True)
    _place(slots, sorted(pending, reverse=True))
    return sorted(slots, reverse=True)


def _place(slots: list[int], sizes: list[int]) -> bool:
    """First-fit decreasing into ``slots`` (mutated); whether every size found a slot."""
    for size in sizes:
        slot = next((i for i, f in enumerate(slots) if f >= size), None)
        if slot is None:
            return False
        slots[slot] -= size
    return True


def admit(service_pods: list[PodSummary], slots: list[int]) -> Admission:
    """Which of a service's gated engine pods to admit into the free ``slots``.

    A gang that fits is admitted largest pods first, and nothing more of the service until
    those are bound: the scheduler then places the big pods while the room is there, rather
    than a small prefill pod taking the one node an 8-GPU decode pod could use."""
    live = [p for p in service_pods if not p.terminating and p.role not in ("proxy", "download")]
    gated = [p for p in live if ADMISSION_GATE in p.gates]
    if not gated or any(ADMISSION_GATE not in p.gates and not p.node for p in live):
        return Admission()  # nothing to admit, or admitted pods still wait for the scheduler
    bound_layouts = {p.kv_layout for p in live if p.node}
    gangs: dict[str | None, list[PodSummary]] = {}
    for pod in gated:
        key = pod.kv_layout if pod.kv_layout not in bound_layouts else pod.name
        gangs.setdefault(key, []).append(pod)
    admitted: list[str] = []
    held: list[str] = []
    for group in sorted(gangs.values(), key=lambda g: -sum(p.gpus for p in g)):
        trial = list(slots)
        if _place(trial, sorted((p.gpus for p in group), reverse=True)):
            slots[:] = trial
            largest = max(p.gpus for p in group)
            admitted += [p.name for p in group if p.gpus == largest]
        else:
            held.append(_why(group, slots))
    return Admission(tuple(admitted), "; ".join(held) or None)


def _why(group: list[PodSummary], slots: list[int]) -> str:
    ordered = sorted(group, key=lambda p: (p.role != "prefill", p.role))
    needs = " + ".join(f"{p.role} {p.gpus}" for p in ordered)
    free = ", ".join(str(f) for f in sorted((f for f in slots if f > 0), reverse=True)) or "none"
    together = "together " if len(group) > 1 else ""
    return (
        f"gang admission holds {len(group)} pod(s) ({needs} {GPU_RESOURCE}): they do not fit "
        f"{together}in the free GPUs per node ({free})"
    )
