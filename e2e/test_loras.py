"""Issue 29 on the real control plane: ``spec.loras`` hot-loads and unloads adapters on the
running engines, no pod restarted.

kwok runs no containers, so the engine is a real ``tandem serve`` on loopback started with
the argv the operator rendered into the Deployment (the model and the ConfigMap's mount
pointed at local directories), and its ``--lora-config`` directory is fed the operator's
ConfigMap exactly as the kubelet projects a configMap volume into a running pod
(``tests.utils.project_config_map``). What the control plane decides (the ConfigMap, the
unchanged pod template, the pods' identities, the status, the CEL rules) is checked on the
API server; what the engine does with the file, through the official ``openai`` client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.cluster import Cluster, wait_for
from e2e.utils import Operator, _apply, _get, _isvc, _wait_ready
from tandem.operator.topology import LORA_CONFIG_KEY, LORA_CONFIG_MOUNT
from tests.hf_reference import peft_greedy
from tests.proxy.utils import openai_client
from tests.utils import ENGINE_FLAGS, ServerProcess, greedy_token_ids, project_config_map

NAME = "adapters"
MODEL = "tiny"  # _isvc's model name
WAIT = 60
# what `tandem serve` gets from the test, not from the rendered argv
OWN_FLAGS = {"--model": 1, "--served-model-name": 1, "--host": 1, "--port": 1}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model and two PEFT adapters of it, made with peft."""
    from tandem.server.engine.tiny_lora import TinyLoraSpec, make_tiny_lora
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("lora-files")
    model = make_tiny_model(root / "model", TinyModelSpec(arch="llama", seed=1))
    return {
        "model": model,
        "sql": make_tiny_lora(model, root / "sql", TinyLoraSpec(rank=4, alpha=8, seed=11)),
        "chat": make_tiny_lora(model, root / "chat", TinyLoraSpec(rank=8, alpha=8, seed=12)),
    }


def _spec(loras: dict[str, Path]) -> dict[str, Any]:
    return {
        "mode": "Aggregated",
        "engine": {"enableLora": True, "maxLoras": 2},
        "loras": [{"name": n, "uri": str(p)} for n, p in loras.items()],
    }


def _engine_state(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """What would show a restart: the engine pods' UIDs, the Deployment's generation and
    template hash, and its ReplicaSets."""
    selector = f"tandem.dev/inferenceservice={NAME},app.kubernetes.io/component=engine"
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    sets = cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", selector)["items"]
    deployment = _get(cluster, "deployment", f"{NAME}-engine", namespace)
    return {
        "pods": sorted(p["metadata"]["uid"] for p in pods),
        "hashes": sorted(p["metadata"]["labels"]["pod-template-hash"] for p in pods),
        "replicasets": sorted(s["metadata"]["name"] for s in sets),
        "generation": deployment["metadata"]["generation"],
    }


def _configmap(cluster: Cluster, namespace: str) -> dict[str, str]:
    return _get(cluster, "configmap", f"{NAME}-loras", namespace)["data"]


def _rendered_argv(cluster: Cluster, namespace: str, volume: Path) -> list[str]:
    """The engine container's args as the operator rendered them, less what the test sets
    itself, with the ConfigMap's mount replaced by the local volume."""
    deployment = _get(cluster, "deployment", f"{NAME}-engine", namespace)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "serve"
    out, skip = [], 0
    for arg in args[1:]:
        if skip:
            skip -= 1
        elif arg in OWN_FLAGS:
            skip = OWN_FLAGS[arg]
        else:
            out.append(arg.replace(LORA_CONFIG_MOUNT, str(volume)))
    return out


def _change_loras(cluster: Cluster, namespace: str, loras: dict[str, Path], volume: Path) -> None:
    """Set ``spec.loras``; wait until the ConfigMap and ``status.loras`` list exactly them;
    then sync the pod's volume from the ConfigMap, as the kubelet does."""
    body = {"spec": {"loras": _spec(loras)["loras"]}}
    cluster.kubectl("patch", "tisvc", NAME, "-n", namespace, "--type=merge", "-p", json.dumps(body))

    def listed() -> bool:
        in_map = json.loads(_configmap(cluster, namespace)[LORA_CONFIG_KEY])
        in_status = _get(cluster, "tisvc", NAME, namespace)["status"]["loras"]
        return [a["name"] for a in in_map] == [a["name"] for a in in_status] == list(loras)

    wait_for(f"the ConfigMap and status to list {list(loras)}", listed, timeout=WAIT)
    project_config_map(volume, _configmap(cluster, namespace))


def _served(client: openai.OpenAI) -> set[str]:
    return {m.id for m in client.models.list()} - {MODEL}


def test_adding_and_removing_an_adapter_restarts_no_pod(
    cluster: Cluster, operator: Operator, namespace: str, files: dict[str, Path], tmp_path: Path
) -> None:
    _apply(cluster, _isvc(NAME, namespace, decode={"replicas": 2}, **_spec({})))
    _wait_ready(cluster, operator, namespace, NAME)
    before = _engine_state(cluster, namespace)
    assert len(before["pods"]) == 2 and len(before["replicasets"]) == 1
    assert json.loads(_configmap(cluster, namespace)[LORA_CONFIG_KEY]) == []

    volume = tmp_path / "loras"  # the pod's view of the ConfigMap volume
    project_config_map(volume, _configmap(cluster, namespace))
    argv = _rendered_argv(cluster, namespace, volume)
    assert f"{volume}/{LORA_CONFIG_KEY}" in argv
    engine = ServerProcess(str(files["model"]), *argv, *ENGINE_FLAGS, served_model_name=MODEL)
    engine.wait_ready()
    try:
        client = openai_client(engine.url, engine.headers)
        assert _served(client) == set()
        prompt = [1, 5, 9, 14, 3, 27, 8]

        # add an adapter: the ConfigMap changes, nothing else does; the engine serves it
        _change_loras(cluster, namespace, {"sql": files["sql"]}, volume)
        assert _engine_state(cluster, namespace) == before
        wait_for("the engine to serve sql", lambda: _served(client) == {"sql"}, timeout=WAIT)
        assert client.models.retrieve("sql").model_extra["parent"] == MODEL
        want = peft_greedy(files["model"], {"sql": files["sql"]}, "sql", prompt, 6)
        assert greedy_token_ids(client, "sql", prompt, 6) == want

        # swap it for another: one loaded, one unloaded, still no restart
        _change_loras(cluster, namespace, {"chat": files["chat"]}, volume)
        wait_for(
            "the engine to serve chat alone", lambda: _served(client) == {"chat"}, timeout=WAIT
        )
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="sql", prompt="x", max_tokens=2)
        assert err.value.code == "model_not_found"
        want = peft_greedy(files["model"], {"chat": files["chat"]}, "chat", prompt, 6)
        assert greedy_token_ids(client, "chat", prompt, 6) == want

        # remove it: unloaded
        _change_loras(cluster, namespace, {}, volume)
        wait_for("the engine to serve no adapter", lambda: _served(client) == set(), timeout=WAIT)
        assert _engine_state(cluster, namespace) == before
    finally:
        code = engine.stop()
        assert code == 0, engine.log_tail()


def test_the_api_server_refuses_adapters_no_running_engine_could_read(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """The CEL rules, in the same words as ``tandem up``: an adapter on a claim the model is
    not on (mounting it would roll the pods), one without enableLora, names that repeat (the
    API server's own check: the list is a map keyed by name)."""
    pvc_model = {"name": MODEL, "uri": "pvc://weights/base"}
    cases = {
        "on the model's own claim": {
            **_spec({}),
            "loras": [{"name": "a", "uri": "pvc://other/a"}],
        },
        "loras need engine.enableLora": {"loras": [{"name": "a", "uri": "/a"}]},
        "Duplicate value": {  # the list is a map keyed by name
            **_spec({}),
            "loras": [{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}],
        },
    }
    for message, spec in cases.items():
        body = _isvc("refused", namespace, **spec)
        body["spec"]["model"] = pvc_model
        result = _apply(cluster, body, check=False)
        assert result.returncode != 0 and message in result.stderr, (message, result.stderr)
    accepted = _isvc("accepted", namespace, **_spec({}))
    accepted["spec"]["model"] = pvc_model
    accepted["spec"]["loras"] = [{"name": "a", "uri": "pvc://weights/adapters/a"}]
    result = _apply(cluster, accepted, check=False)
    assert result.returncode == 0, result.stderr
