"""P/D-safe rollouts (issue 31): while engines of an old KV layout exist and no ready
prefill+decode pair of the new one does, the engine Deployments hold the old pods."""

from __future__ import annotations

from tandem.operator.render.manifests import render
from tandem.operator.render.options import RenderOptions
from tandem.operator.rollout import hold_old_layout
from tandem.operator.status.children import PodSummary
from tandem.operator.topology import plan

from .utils import isvc


def _pod(role: str, layout: str, ready: bool = True, terminating: bool = False) -> PodSummary:
    return PodSummary(role, ready, kv_layout=layout, terminating=terminating)


def test_the_old_layout_is_held_until_a_new_pair_is_ready() -> None:
    topology = plan(isvc(engine={"blockSize": 32}))
    new = topology.kv_layout
    old_pair = [_pod("prefill", "old"), _pod("decode", "old"), _pod("proxy", "", True)]
    assert not hold_old_layout(topology, [])  # creation: nothing to keep
    assert not hold_old_layout(topology, [_pod("prefill", new), _pod("decode", new)])
    assert hold_old_layout(topology, old_pair)  # the spec just changed
    assert hold_old_layout(topology, [*old_pair, _pod("prefill", new)])  # no new decode yet
    not_ready = [*old_pair, _pod("prefill", new), _pod("decode", new, ready=False)]
    assert hold_old_layout(topology, not_ready)
    paired = [*old_pair, _pod("prefill", new), _pod("decode", new)]
    assert not hold_old_layout(topology, paired)  # a new pair serves: roll on
    gone = [_pod("prefill", "old", terminating=True), _pod("decode", new), _pod("prefill", new)]
    assert not hold_old_layout(topology, gone)
    aggregated = plan(isvc(mode="Aggregated"))
    assert not hold_old_layout(aggregated, [_pod("both", "old")])


def test_a_hold_renders_min_ready_seconds_on_both_engine_pools_only() -> None:
    svc = isvc()
    held = render(svc, RenderOptions(hold_old_layout=True))
    deployments = {o["metadata"]["name"]: o["spec"] for o in held if o["kind"] == "Deployment"}
    for pool in ("svc-prefill", "svc-decode"):
        spec = deployments[pool]
        assert spec["minReadySeconds"] == spec["progressDeadlineSeconds"] - 1
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "minReadySeconds" not in deployments["svc-proxy"]
    released = render(svc, RenderOptions())
    assert not any("minReadySeconds" in o["spec"] for o in released if o["kind"] == "Deployment")
