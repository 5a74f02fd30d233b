"""P/D-safe rollouts: a change of the KV layout keeps a same-layout prefill+decode pair
serving at every moment. Pure.

Prefill and decode roll as two Deployments, surge first; left alone, the old prefill goes
as soon as one new prefill is Ready, before any new-layout decode is, and for a whole model
load no prefill and decode can pair. So while engine pods of another layout exist and no
ready prefill+decode pair of the new layout does, both engine Deployments are rendered with
``minReadySeconds`` of their progress deadline: the new pods start and turn Ready (the
proxy pairs them as soon as both roles have one), but they do not count as available, so
the Deployment controller keeps every old pod (``maxUnavailable: 0``). Once a new pair is
Ready the hold is dropped (a level-triggered re-apply on that pod event) and both roll on,
with a pair of the new layout already serving.
"""

from __future__ import annotations

from .status.children import PodSummary
from .topology import Topology


def hold_old_layout(topology: Topology, pods: list[PodSummary]) -> bool:
    """Whether the old layout's engines must be kept: a Disaggregated service with engine
    pods of another KV layout, and no ready prefill and decode of the new one."""
    if topology.mode != "Disaggregated":
        return False
    engines = [
        p
        for p in pods
        if p.role in ("prefill", "decode") and not p.terminating and not p.group_worker
    ]
    if not any(p.kv_layout != topology.kv_layout for p in engines):
        return False
    ready = {p.role for p in engines if p.ready and p.kv_layout == topology.kv_layout}
    return ready != {"prefill", "decode"}
