"""Ollama parity for its own clients and habits (engine, aggregated proxy, P/D proxy): the
official ``ollama`` client's list/show/embed/pull, litellm's ``ollama/`` and ``ollama_chat/``
providers, bodies sent without a JSON Content-Type (``curl -d``), and ``/api/tags`` and
``/api/show`` describing the weights truthfully (a GGUF's family, size and quantisation)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import ollama
import pytest
import torch

from tandem.server.engine.default_model import NAME, default_model_path
from tandem.server.engine.model_details import describe

from ..proxy.utils import FRONTS, front_of, openai_client
from ..utils import ENGINE_FLAGS, ServerProcess

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
# litellm reads its model-cost map from the network unless told not to; no telemetry either.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")


@pytest.fixture(params=FRONTS)
def front(request, stack) -> tuple[str, dict[str, str]]:
    return front_of(stack, request.param)


def test_list_and_show_describe_the_weights(front, llama_dir: Path) -> None:
    url, headers = front
    client = ollama.Client(host=url, headers=headers)
    want = describe(llama_dir)
    (entry,) = client.list().models
    assert entry.model == MODEL and entry.size == want.size > 0
    d = entry.details
    assert (d.format, d.family, d.parameter_size, d.quantization_level) == (
        "safetensors",
        "llama",
        want.parameter_size,
        "F32",
    )
    shown = client.show(MODEL)
    assert shown.details.family == "llama" and shown.details.parameter_size == want.parameter_size
    info = shown.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.context_length"] == 512
    assert info["general.parameter_count"] == want.parameter_count


def test_gguf_details_are_read_from_the_file() -> None:
    gguf = default_model_path()
    d = describe(gguf)
    assert (d.format, d.family, d.quantization_level) == ("gguf", "llama", "Q4_1")
    assert d.parameter_size == "134.52M" and d.size == gguf.stat().st_size


def test_embed_and_embeddings_equal_the_openai_route(front) -> None:
    url, headers = front
    client = ollama.Client(host=url, headers=headers)
    texts = ["hello there", "the quick brown fox"]
    got = client.embed(model=MODEL, input=texts)
    assert got.model == MODEL and len(got.embeddings) == 2 and got.prompt_eval_count > 0
    ref = openai_client(url, headers).embeddings.create(model=MODEL, input=texts)
    for mine, theirs in zip(got.embeddings, ref.data):
        assert torch.allclose(torch.tensor(mine), torch.tensor(theirs.embedding), atol=1e-6)
    raw = client.embeddings(model=MODEL, prompt=texts[0]).embedding
    assert abs(torch.tensor(raw).norm().item() - 1.0) > 1e-3  # Ollama's older route: raw
    unit = torch.nn.functional.normalize(torch.tensor(raw), dim=0)
    assert torch.allclose(unit, torch.tensor(got.embeddings[0]), atol=1e-5)


def test_pull_of_the_served_model_and_refusal_of_others(front) -> None:
    url, headers = front
    client = ollama.Client(host=url, headers=headers)
    assert client.pull(MODEL).status == "success"
    assert [p.status for p in client.pull(MODEL, stream=True)][-1] == "success"
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("llama3:70b")
    assert err.value.status_code == 404


def test_pull_of_the_default_model_fills_the_cache_without_the_network(
    tmp_path: Path,
) -> None:
    """The default (by its Ollama-style names) is fetched into the server's cache; here the
    cache holds it already (a link to the tests' copy), so nothing reaches the network."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    gguf = default_model_path()
    (cache / "models" / gguf.name).symlink_to(gguf)
    srv = ServerProcess(
        str(gguf),
        *ENGINE_FLAGS,
        served_model_name=NAME,
        log_path=tmp_path / "s.log",
        env={"TANDEM_CACHE": str(cache), "PIP_NO_INDEX": "1"},
    )
    try:
        srv.wait_ready(timeout=300)
        client = ollama.Client(host=srv.url)
        for name in (NAME, "smollm2:135m", "SmolLM2-135M-Instruct"):
            assert client.pull(name).status == "success", name
        (entry,) = client.list().models
        assert entry.details.quantization_level == "Q4_1" and entry.size == gguf.stat().st_size
    finally:
        srv.stop()


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_bodies_without_a_json_content_type_are_read_as_json(front, content_type) -> None:
    """``curl -d`` sends form-urlencoded; some clients send no Content-Type at all."""
    url, headers = front
    hdrs = {k: v for k, v in headers.items()}
    if content_type:
        hdrs["Content-Type"] = content_type
    body = b'{"model": "tiny", "prompt": "Once", "stream": false, "options": {"num_predict": 3}}'
    r = httpx.post(url + "/api/generate", content=body, headers=hdrs)
    assert r.status_code == 200, r.text
    assert r.json()["done"] and r.json()["eval_count"] == 3
    r = httpx.post(url + "/api/show", content=b'{"model": "tiny"}', headers=hdrs)
    assert r.status_code == 200 and r.json()["details"]["family"] == "llama"
    r = httpx.post(url + "/api/embed", content=b'{"model": "tiny", "input": "x"}', headers=hdrs)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 1
    # OpenAI's routes keep refusing a body that is not declared JSON
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}', headers=hdrs)
    assert r.status_code == 415


def test_litellm_ollama_providers(front) -> None:
    import litellm

    litellm.telemetry = False
    url, headers = front
    key = headers.get("Authorization", "Bearer none").split()[-1]
    messages = [{"role": "user", "content": "Say hi"}]
    for provider in ("ollama", "ollama_chat"):
        r = litellm.completion(
            model=f"{provider}/{MODEL}",
            api_base=url,
            api_key=key,
            messages=messages,
            max_tokens=5,
            temperature=0,
            extra_headers=headers,
        )
        assert r.choices[0].message.content, provider
        assert r.usage.completion_tokens == 5, provider
