"""The picker finding its engines from the InferencePool itself (``--pool-name``), as GIE's
picker does: the pool's selector and target port read from the object the operator renders
(the real shape, ``inference.networking.k8s.io/v1``), its pods tracked into the registry,
and a change of the pool (another selector, another port) or its deletion followed."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tandem.operator.render.manifests import render
from tandem.server.picker import pool as pool_module
from tandem.server.picker.pool import PoolApi, pool_target, watch_pool
from tandem.server.proxy.discovery import PodTracker
from tandem.server.proxy.registry import Registry

from ..operator.utils import by_kind_name, isvc


def _rendered_pool() -> dict[str, Any]:
    """The InferencePool the operator renders for ``router: gateway``."""
    service = isvc(router="gateway", proxy={"apiKeySecret": {"name": "keys"}})
    return by_kind_name(render(service))[("InferencePool", "svc")]


def _pod(name: str, ip: str, role: str | None = None) -> dict[str, Any]:
    labels = {"tandem.dev/inferenceservice": "svc", **({"tandem.dev/role": role} if role else {})}
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "labels": labels},
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 1}]}]
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_the_rendered_pools_selector_and_target_port() -> None:
    pool = _rendered_pool()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    target = pool_target(pool)
    labels = pool["spec"]["selector"]["matchLabels"]
    assert target.selector == ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    assert "tandem.dev/inferenceservice=svc" in target.selector.split(",")
    assert target.port == pool["spec"]["targetPorts"][0]["number"] == 8000
    older = {"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8001}}  # v1alpha2
    assert pool_target(older) == type(target)("app=vllm", 8001)
    for broken in ({"spec": {"targetPorts": [{"number": 1}]}}, {"spec": {"selector": labels}}):
        with pytest.raises(ValueError):
            pool_target(broken)


def test_the_pools_pods_become_engines_and_the_pool_is_followed(monkeypatch) -> None:
    """First the rendered pool: its pods (a prefill one by its role label, one without the
    label: an engine serving both) at the pool's port, a pod deleted. Then the pool edited
    (another port): the engines move. Then the pool deleted: no engines."""
    monkeypatch.setattr(pool_module, "REREAD_SECONDS", 0.01)  # a missing pool's retry
    rendered = _rendered_pool()
    moved = {**rendered, "spec": {**rendered["spec"], "targetPorts": [{"number": 8100}]}}
    pools = iter([rendered, moved, None])
    registry = Registry()
    stop = threading.Event()
    seen: list[dict[str, str]] = []
    selectors: list[str] = []

    def get_pool() -> dict[str, Any] | None:
        seen.append({n.url: n.role for n in registry.nodes()})
        pool = next(pools, None)
        if pool is None and len(seen) > 3:
            stop.set()
        return pool

    def list_pods(selector: str) -> tuple[list[dict[str, Any]], str]:
        selectors.append(selector)
        pods = [_pod("a", "10.0.0.1", "prefill"), _pod("b", "10.0.0.2"), _pod("c", "10.0.0.3")]
        return pods, "7"

    def watch_pods(selector: str, version: str, seconds: int):
        assert (selector, version) == (selectors[-1], "7")
        yield "DELETED", _pod("c", "10.0.0.3")

    api = PoolApi(get_pool, list_pods, watch_pods)
    watch_pool(api, lambda change: change(), PodTracker(registry, default_role="both"), stop)
    assert selectors == [pool_target(rendered).selector] * 2
    assert seen[1] == {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "both"}
    assert seen[2] == {"http://10.0.0.1:8100": "prefill", "http://10.0.0.2:8100": "both"}
    assert seen[3] == {}  # the pool is gone: nothing to route to


def test_pool_name_is_the_discovery_as_the_operator_runs_the_picker() -> None:
    import argparse

    from tandem.server.picker.cli import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--pool-name", "svc"]))
    assert settings.discovery is not None and not settings.static_nodes
    service = isvc(router="gateway", proxy={"apiKeySecret": {"name": "keys"}})
    objs = by_kind_name(render(service))
    args = objs[("Deployment", "svc-epp")]["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = parser.parse_args(args[1:])
    assert (parsed.pool_name, parsed.namespace) == ("svc", "ml")
    assert {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "resourceNames": ["svc"],
        "verbs": ["get"],
    } in objs[("Role", "svc-epp")]["rules"]
