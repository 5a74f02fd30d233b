"""``--lora-config`` on a real ``tandem serve`` (issue 29, the operator's ``spec.loras``): the
file lives in a directory written as the kubelet projects a ConfigMap volume, and every
change to it is seen without a restart. An adapter added to it appears in ``/v1/models``
with ``parent`` = the base and serves ``model`` = its name through the official ``openai``
client (greedy tokens equal PEFT's); one removed is unloaded (404 ``model_not_found``); one
whose path changes is swapped with no moment of 404 (and kept when the new path fails); a
broken adapter or a broken file is reported in ``/health`` and ``tandem:lora_config_errors``
while everything else keeps serving; an adapter loaded by HTTP is not the file's to unload."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from ..hf_reference import peft_greedy
from ..proxy.utils import metric_value, openai_client
from ..utils import (
    ADMIN_KEY,
    ServerProcess,
    greedy_token_ids,
    project_config_map,
    serving,
    wait_until,
)
from .utils import LORA_BASE, lora_engine

pytestmark = pytest.mark.timeout(300)
BASE = LORA_BASE
N = 8
KEY = "loras.json"  # the ConfigMap's key, as the operator renders it


def _config(**adapters: Path) -> dict[str, str]:
    return {KEY: json.dumps([{"name": n, "path": str(p)} for n, p in adapters.items()])}


def _served(client: openai.OpenAI) -> set[str]:
    return {m.id for m in client.models.list()} - {BASE}


def _health(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/health", headers=server.headers, timeout=10).json()


def _wait_served_from(client: openai.OpenAI, name: str, path: Path) -> None:
    """Until the adapter ``name`` is served from ``path`` (its model card's ``root``)."""
    wait_until(
        lambda: client.models.retrieve(name).model_extra["root"] == str(path),
        timeout=60,
        what=f"{name} served from {path}",
    )


def _errors_metric(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    return metric_value(text, "tandem:lora_config_errors")


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora-volume")
    project_config_map(path, _config())
    return path


@pytest.fixture(scope="module")
def server(tiny_models, volume: Path, tmp_path_factory: pytest.TempPathFactory):
    flags = ["--lora-config", str(volume / KEY), "--max-loras", "2"]
    logs = tmp_path_factory.mktemp("lora-config-log")
    with serving(lora_engine(tiny_models["llama"], logs, *flags)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server.url, server.headers)


def test_an_adapter_added_to_the_file_serves_and_one_removed_is_unloaded(
    server, client, volume, tiny_models, tiny_loras, lora_prompt_ids
) -> None:
    loras = tiny_loras["llama"]
    project_config_map(volume, _config(sql=loras["qv-r4"]))
    wait_until(lambda: _served(client) == {"sql"}, timeout=60, what="sql served")
    card = client.models.retrieve("sql")
    assert card.model_extra["parent"] == BASE and card.model_extra["root"] == str(loras["qv-r4"])
    want = peft_greedy(tiny_models["llama"], {"sql": loras["qv-r4"]}, "sql", lora_prompt_ids, N)
    assert greedy_token_ids(client, "sql", lora_prompt_ids, N) == want

    project_config_map(volume, _config(sql=loras["qv-r4"], chat=loras["all-r8"]))
    wait_until(lambda: _served(client) == {"sql", "chat"}, timeout=60, what="chat served")
    want = peft_greedy(tiny_models["llama"], {"chat": loras["all-r8"]}, "chat", lora_prompt_ids, N)
    assert greedy_token_ids(client, "chat", lora_prompt_ids, N) == want

    project_config_map(volume, _config(chat=loras["all-r8"]))
    wait_until(lambda: _served(client) == {"chat"}, timeout=60, what="sql unloaded")
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="sql", prompt="x", max_tokens=2)
    assert err.value.code == "model_not_found"
    assert _health(server)["lora_config"]["adapters"] == ["chat"]


def test_a_changed_path_reloads_the_adapter_under_its_name(
    server, client, volume, tiny_models, tiny_loras, lora_prompt_ids
) -> None:
    loras = tiny_loras["llama"]
    project_config_map(volume, _config(chat=loras["ko-r2"]))
    _wait_served_from(client, "chat", loras["ko-r2"])
    want = peft_greedy(tiny_models["llama"], {"chat": loras["ko-r2"]}, "chat", lora_prompt_ids, N)
    assert greedy_token_ids(client, "chat", lora_prompt_ids, N) == want


def test_a_new_path_that_does_not_load_leaves_the_old_version_serving(
    server, client, volume, tiny_models, tiny_loras, lora_prompt_ids, tmp_path
) -> None:
    loras = tiny_loras["llama"]
    project_config_map(volume, _config(chat=loras["all-r8"]))
    _wait_served_from(client, "chat", loras["all-r8"])
    project_config_map(volume, _config(chat=tmp_path / "nowhere"))
    wait_until(
        lambda: "chat" in _health(server)["lora_config"]["errors"], timeout=60, what="reported"
    )
    assert client.models.retrieve("chat").model_extra["root"] == str(loras["all-r8"])
    want = peft_greedy(tiny_models["llama"], {"chat": loras["all-r8"]}, "chat", lora_prompt_ids, N)
    assert greedy_token_ids(client, "chat", lora_prompt_ids, N) == want

    project_config_map(volume, _config(chat=loras["all-r8"]))  # back to what is served
    wait_until(lambda: _errors_metric(server) == 0, timeout=60, what="error cleared")
    assert _health(server)["lora_config"]["errors"] == {}


def test_broken_adapters_and_files_are_reported_and_the_rest_keeps_serving(
    server, client, volume, tiny_models, tiny_loras, lora_prompt_ids, tmp_path
) -> None:
    loras = tiny_loras["llama"]
    good = loras["mlp-r16"]
    project_config_map(
        volume,
        _config(good=good, missing=tmp_path / "nowhere", other=tiny_loras["qwen3"]["all-r8"]),
    )
    wait_until(
        lambda: set(_health(server)["lora_config"]["errors"]) == {"missing", "other"},
        timeout=60,
        what="both broken adapters reported",
    )
    assert _served(client) == {"good"}
    assert _errors_metric(server) == 2
    want = peft_greedy(tiny_models["llama"], {"good": good}, "good", lora_prompt_ids, N)
    assert greedy_token_ids(client, "good", lora_prompt_ids, N) == want

    project_config_map(volume, {KEY: '[{"name": "good"}]'})  # no path: the file is refused
    wait_until(
        lambda: "" in _health(server)["lora_config"]["errors"], timeout=60, what="file refused"
    )
    assert _served(client) == {"good"}  # the last good file's adapters stay served
    assert greedy_token_ids(client, BASE, lora_prompt_ids, N) == peft_greedy(
        tiny_models["llama"], {"good": good}, None, lora_prompt_ids, N
    )

    project_config_map(volume, _config(good=good))
    wait_until(lambda: _errors_metric(server) == 0, timeout=60, what="errors cleared")
    assert _health(server)["lora_config"]["errors"] == {}


def test_an_adapter_loaded_by_http_is_left_alone(server, client, volume, tiny_loras) -> None:
    loras = tiny_loras["llama"]
    body = {"lora_name": "by-hand", "lora_path": str(loras["qv-r4"])}
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    project_config_map(volume, _config())
    wait_until(lambda: _served(client) == {"by-hand"}, timeout=60, what="file's adapters gone")
    # the file may not take a name already served: reported, the served one untouched
    project_config_map(volume, _config(**{"by-hand": loras["all-r8"]}))
    wait_until(
        lambda: "by-hand" in _health(server)["lora_config"]["errors"],
        timeout=60,
        what="name taken reported",
    )
    assert client.models.retrieve("by-hand").model_extra["root"] == str(loras["qv-r4"])
