"""``spec.loras`` (issue 29): the adapters go into a ConfigMap of their own that every engine
pod mounts as a directory and reads through ``--lora-config``, never into the pod template,
so adding or removing an adapter changes no template (no pod restarts); the rules refuse
what could not reach a running engine; the status lists the adapters as the engines get them."""

from __future__ import annotations

import json

import pytest

from tandem.operator.kube import object_path
from tandem.operator.render.manifests import render
from tandem.operator.status.compute import as_patch, compute_status
from tandem.operator.topology import plan

from .test_topology import parse
from .utils import UID, by_kind_name, healthy, isvc

LORA = {"enableLora": True, "maxLoras": 2}
MODEL_ON_PVC = {"name": "tiny", "uri": "pvc://weights/base/tiny"}
CONFIG = "/etc/tandem/loras/loras.json"


def _loras(**adapters: str) -> list[dict[str, str]]:
    return [{"name": n, "uri": u} for n, u in adapters.items()]


def test_the_adapters_are_a_configmap_mounted_as_a_directory() -> None:
    svc = isvc(
        model=MODEL_ON_PVC,
        engine=LORA,
        loras=_loras(sql="pvc://weights/adapters/sql", chat="/opt/adapters/chat"),
    )
    objs = by_kind_name(render(svc))
    cm = objs[("ConfigMap", "svc-loras")]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == UID
    assert json.loads(cm["data"]["loras.json"]) == [
        {"name": "sql", "path": "/models/pvc/adapters/sql"},
        {"name": "chat", "path": "/opt/adapters/chat"},
    ]
    assert (
        object_path(cm) == "/api/v1/namespaces/ml/configmaps/svc-loras"
    )  # the operator applies it
    for role in ("prefill", "decode"):
        pod = objs[("Deployment", f"svc-{role}")]["spec"]["template"]["spec"]
        assert {"name": "loras", "configMap": {"name": "svc-loras"}} in pod["volumes"]
        engine = pod["containers"][0]
        mount = next(m for m in engine["volumeMounts"] if m["name"] == "loras")
        # a whole directory: the kubelet never updates a subPath mount
        assert mount == {"name": "loras", "mountPath": "/etc/tandem/loras", "readOnly": True}
        args = engine["args"]
        assert args[args.index("--lora-config") + 1] == CONFIG


def test_changing_the_adapters_changes_no_pod_template() -> None:
    """The Deployment's template (what its pod-template-hash is computed from) is the same
    with no adapter, one, and two; only the ConfigMap differs."""
    rendered = [
        by_kind_name(render(isvc(engine=LORA, loras=_loras(**adapters))))
        for adapters in ({}, {"a": "/x/a"}, {"a": "/x/a", "b": "/x/b"})
    ]
    for key in [k for k in rendered[0] if k[0] == "Deployment"]:
        templates = [objs[key]["spec"]["template"] for objs in rendered]
        assert templates[0] == templates[1] == templates[2], key
    data = [objs[("ConfigMap", "svc-loras")]["data"]["loras.json"] for objs in rendered]
    assert len(set(data)) == 3
    assert (
        plan(isvc(engine=LORA)).kv_layout == plan(isvc(engine=LORA, loras=_loras(a="/a"))).kv_layout
    )


def test_without_enable_lora_there_is_no_configmap_mount_or_flag() -> None:
    objs = by_kind_name(render(isvc()))
    assert not [k for k in objs if k[0] == "ConfigMap"]
    pod = objs[("Deployment", "svc-decode")]["spec"]["template"]["spec"]
    assert "--lora-config" not in pod["containers"][0]["args"]
    assert all(v["name"] != "loras" for v in pod["volumes"])


def test_the_engines_argv_parses_into_a_lora_config() -> None:
    from tandem.server.engine.engine_args import engine_config_from_args

    args = parse(plan(isvc(engine=LORA, loras=_loras(a="/a"))).role("decode").args)
    config = engine_config_from_args(args, "/models/tiny")
    assert (config.lora_config, config.lora_enabled, config.max_loras) == (CONFIG, True, 2)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"loras": _loras(a="/a")}, "loras need engine.enableLora"),
        ({"engine": LORA, "loras": _loras(a="/a") * 2}, "loras names must be distinct"),
        ({"engine": LORA, "loras": _loras(tiny="/a")}, "differ from model.name"),
        ({"engine": LORA, "loras": _loras(default="/a")}, "differ from model.name and 'default'"),
        ({"engine": LORA, "loras": _loras(a="hf://org/adapter")}, "loras\\[\\].uri must be"),
        ({"engine": LORA, "loras": _loras(a="relative/path")}, "loras\\[\\].uri must be"),
        # a claim the model is not on would have to be mounted: a new pod template
        (
            {"model": MODEL_ON_PVC, "engine": LORA, "loras": _loras(a="pvc://other/a")},
            "on the model's own claim",
        ),
        ({"model": MODEL_ON_PVC, "engine": LORA, "loras": _loras(a="pvc://weights/")}, "uri"),
        ({"engine": LORA, "loras": _loras(a="pvc://weights/a")}, "on the model's own claim"),
        ({"engine": LORA, "loras": _loras(**{"bad name": "/a"})}, "pattern"),
    ],
)
def test_adapters_that_could_not_reach_a_running_engine_are_refused(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        isvc(**spec)


def test_status_lists_the_adapters_as_the_engines_get_them() -> None:
    svc = isvc(
        model=MODEL_ON_PVC,
        engine=LORA,
        loras=_loras(sql="pvc://weights/adapters/sql", chat="/opt/chat"),
    )
    status = compute_status(svc, plan(svc), healthy(svc), 1, "t0")
    assert as_patch(status)["loras"] == [
        {"name": "sql", "uri": "pvc://weights/adapters/sql", "path": "/models/pvc/adapters/sql"},
        {"name": "chat", "uri": "/opt/chat", "path": "/opt/chat"},
    ]
    bare = isvc(engine=LORA)
    assert as_patch(compute_status(bare, plan(bare), healthy(bare), 1, "t0"))["loras"] == []
