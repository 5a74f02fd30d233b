"""Gang admission with schedulingGates (issue 31): gated engine pods are admitted only when
their gang fits the free GPUs the operator sees."""

from __future__ import annotations

from tandem.operator.admission import GpuPod, admit, free_gpus
from tandem.operator.render.manifests import render
from tandem.operator.render.meta import ADMISSION_GATE
from tandem.operator.render.options import RenderOptions
from tandem.operator.status.children import Children, Facts, PodSummary
from tandem.operator.status.compute import compute_status
from tandem.operator.topology import plan

from .utils import conds, dep, isvc, message, ready_pods

GATED = (ADMISSION_GATE,)


def _gated(name: str, role: str, gpus: int, layout: str = "L1") -> PodSummary:
    return PodSummary(role, False, kv_layout=layout, name=name, gpus=gpus, gates=GATED)


def test_free_gpus_subtract_bound_and_ungated_pending_pods() -> None:
    nodes = {"a": 8, "b": 8}
    pods = [GpuPod("a", 4, False), GpuPod(None, 8, False), GpuPod(None, 8, True)]
    # a: 8-4 = 4; the ungated pending 8 takes b; the gated one holds nothing
    assert free_gpus(nodes, pods) == [4, 0]


def test_a_new_service_is_admitted_whole_or_not_at_all() -> None:
    pods = [_gated("p", "prefill", 4), _gated("d", "decode", 8)]
    held = admit(pods, [4, 0])
    assert held.admit == () and "prefill 4 + decode 8" in (held.held or "")
    assert "do not fit together in the free GPUs per node (4)" in (held.held or "")
    whole = admit(pods, [8, 4])
    assert whole.admit == ("d",) and whole.held is None  # the largest first
    unbound = [_gated("p", "prefill", 4), PodSummary("decode", False, kv_layout="L1", name="d")]
    assert admit(unbound, [8, 4]) == admit([], [8])  # nothing more until the scheduler binds d
    bound = [_gated("p", "prefill", 4)] + [
        PodSummary("decode", False, kv_layout="L1", name="d", gpus=8, node="b")
    ]
    assert admit(bound, [4]).admit == ("p",)


def test_pods_joining_an_admitted_layout_are_admitted_one_by_one() -> None:
    running = PodSummary("decode", True, kv_layout="L1", name="d0", gpus=8, node="a")
    pods = [running, _gated("d1", "decode", 8), _gated("d2", "decode", 8)]
    result = admit(pods, [8, 0])
    assert len(result.admit) == 1 and "1 pod(s)" in (result.held or "")
    # a layout-changing rollout's new pair is a gang of its own
    pods = [running, _gated("p2", "prefill", 1, "L2"), _gated("d3", "decode", 4, "L2")]
    assert admit(pods, [1]).admit == ()
    assert admit(pods, [4, 1]).admit == ("d3",)


def test_gpu_engine_pods_are_rendered_gated_and_cpu_ones_are_not() -> None:
    svc = isvc(prefill={"gpus": 1}, decode={"gpus": 0})
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in render(svc, RenderOptions(admission_gates=True))
        if o["kind"] == "Deployment"
    }
    assert pods["svc-prefill"]["schedulingGates"] == [{"name": ADMISSION_GATE}]
    assert (
        "schedulingGates" not in pods["svc-decode"] and "schedulingGates" not in pods["svc-proxy"]
    )
    podgroup = render(svc, RenderOptions(admission_gates=True, gang_scheduling=True))
    assert not any("schedulingGates" in str(o) for o in podgroup)  # the PodGroup API instead


def test_held_pods_say_what_is_held_and_why() -> None:
    svc = isvc(prefill={"gpus": 4}, decode={"gpus": 8})
    why = "gang admission holds 2 pod(s) (decode 8 + prefill 4 nvidia.com/gpu): ..."
    kids = Children(
        deployments=[dep("prefill", 1, 0), dep("decode", 1, 0), dep("proxy", 1, 1)],
        pods=[_gated("p", "prefill", 4), _gated("d", "decode", 8), *ready_pods("proxy", 1)],
    )
    status = compute_status(svc, plan(svc), kids, 1, "t0", facts=Facts(held=why))
    assert conds(status)["PrefillReady"] == ("False", "WaitingForGPUs")
    assert conds(status)["Ready"] == ("False", "WaitingForGPUs")
    assert why in message(status, "Ready")
