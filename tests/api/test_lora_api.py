"""Multi-LoRA over HTTP on a real ``tandem serve`` process: the official ``openai`` client
selects adapters by ``model`` (greedy tokens equal PEFT's), ``/v1/models`` lists them with
``parent`` = the base, vLLM's load/unload routes take the admin key and refuse a client's,
unknown adapters are 404 ``model_not_found``, malformed ones a 400 that leaves the server
serving, the native and Ollama routes take adapter names, and ``vllm:lora_requests_info``
carries the running and waiting adapters as the GIE model-server protocol says."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import ollama
import openai
import pytest

from ..hf_reference import peft_greedy
from ..proxy.utils import openai_client
from ..utils import (
    ADMIN_KEY,
    API_KEY,
    ServerProcess,
    greedy_token_ids,
    held,
    serving,
    wait_until,
)
from .utils import LORA_BASE, LORA_PROMPT, lora_engine

pytestmark = pytest.mark.timeout(300)
BASE, PROMPT = LORA_BASE, LORA_PROMPT
N = 8


@pytest.fixture(scope="module")
def server(tiny_models, tiny_loras, tmp_path_factory: pytest.TempPathFactory):
    loras = tiny_loras["llama"]
    flags = ["--lora-modules", f"qv-r4={loras['qv-r4']}", f"all-r8={loras['all-r8']}"]
    logs = tmp_path_factory.mktemp("lora-log")
    with serving(lora_engine(tiny_models["llama"], logs, *flags, "--max-loras", "2")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server.url, server.headers)


@pytest.fixture(scope="module")
def prompt_ids(lora_prompt_ids: list[int]) -> list[int]:
    return lora_prompt_ids


def _admin(server: ServerProcess, path: str, body: dict, key: str = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_models_lists_adapters_with_their_parent(client: openai.OpenAI, tiny_loras) -> None:
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {BASE, "qv-r4", "all-r8"}
    for name in ("qv-r4", "all-r8"):
        assert models[name].model_extra["parent"] == BASE
        assert models[name].model_extra["root"] == str(tiny_loras["llama"][name])
    assert client.models.retrieve("all-r8").model_extra["parent"] == BASE


def test_model_selects_the_adapter(client, tiny_models, tiny_loras, prompt_ids) -> None:
    loras = {n: tiny_loras["llama"][n] for n in ("qv-r4", "all-r8")}
    for model, name in [(BASE, None), ("qv-r4", "qv-r4"), ("all-r8", "all-r8")]:
        want = peft_greedy(tiny_models["llama"], loras, name, prompt_ids, N)
        assert greedy_token_ids(client, model, prompt_ids, N) == want, model
    chat = client.chat.completions.create(
        model="qv-r4", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "qv-r4"


def test_unknown_adapter_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)
    assert err.value.code == "model_not_found"


def test_load_and_unload_take_the_admin_key(server, client, tiny_models, tiny_loras, prompt_ids):
    path = str(tiny_loras["llama"]["ko-r2"])
    body = {"lora_name": "late", "lora_path": path}
    assert _admin(server, "/v1/load_lora_adapter", body, key=API_KEY).status_code == 403
    r = _admin(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert _admin(server, "/v1/load_lora_adapter", body).status_code == 400  # already loaded
    want = peft_greedy(tiny_models["llama"], {"late": path}, "late", prompt_ids, N)
    assert greedy_token_ids(client, "late", prompt_ids, N) == want
    assert "late" in {m.id for m in client.models.list()}
    gone = {"lora_name": "late"}
    assert _admin(server, "/v1/unload_lora_adapter", gone, key=API_KEY).status_code == 403
    assert _admin(server, "/v1/unload_lora_adapter", gone).status_code == 200
    assert _admin(server, "/v1/unload_lora_adapter", gone).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)


def test_malformed_adapters_are_400_and_the_server_keeps_serving(
    server, client, tiny_models, tiny_loras, tmp_path, prompt_ids
) -> None:
    bad_rank = tmp_path / "rank"
    bad_rank.mkdir()
    src = tiny_loras["llama"]["qv-r4"]
    (bad_rank / "adapter_config.json").write_text(
        (src / "adapter_config.json").read_text().replace('"r": 4', '"r": 128')
    )
    (bad_rank / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    for path in [tmp_path / "missing", bad_rank, tiny_loras["qwen3"]["all-r8"]]:
        r = _admin(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_lora_adapter"
    loras = {"qv-r4": src}
    assert greedy_token_ids(client, "qv-r4", prompt_ids, N) == peft_greedy(
        tiny_models["llama"], loras, "qv-r4", prompt_ids, N
    )


def test_native_and_ollama_routes_take_the_adapter(server, client, prompt_ids) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = (
        client.completions.create(
            model="all-r8",
            prompt=PROMPT,
            max_tokens=N,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    native = httpx.post(
        server.url + "/generate",
        json={
            "model": "all-r8",
            "prompt": PROMPT,
            "max_tokens": N,
            "temperature": 0,
            "ignore_eos": True,
        },
        headers=headers,
        timeout=60,
    )
    assert native.status_code == 200 and native.json()["text"] == text
    out = ollama.Client(host=server.url, headers=headers).generate(
        model="all-r8", prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": N}
    )
    assert out.response == text
    missing = httpx.post(
        server.url + "/generate", json={"model": "nope", "prompt": "x"}, headers=headers, timeout=60
    )
    assert missing.status_code == 404


def _lora_info(server: ServerProcess) -> dict[str, str]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def test_lora_requests_info_names_running_and_waiting_adapters(server, client) -> None:
    assert _lora_info(server) == {
        "max_lora": "2",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool, held(server):
        futures = [
            pool.submit(client.completions.create, model=m, prompt=PROMPT, max_tokens=4)
            for m in ("qv-r4", "all-r8")
        ]
        wait_until(
            lambda: (
                set(_lora_info(server)["waiting_lora_adapters"].split(",")) == {"qv-r4", "all-r8"}
            ),
            what="both adapters waiting",
        )
    assert all(f.result().choices[0].text is not None for f in futures)
    wait_until(lambda: _lora_info(server)["waiting_lora_adapters"] == "", what="done")


def test_structured_output_n_and_streams_through_an_adapter(client: openai.OpenAI) -> None:
    kw = dict(model="all-r8", prompt="Answer:", max_tokens=40, seed=1)
    r = client.completions.create(n=2, extra_body={"guided_regex": r"[0-9]{3}"}, **kw)
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    assert all(len(c.text) == 3 and c.text.isdigit() for c in r.choices)
    chunks = client.completions.create(
        stream=True, extra_body={"guided_choice": ["alpha", "beta"]}, **kw
    )
    pieces = [(c.model, c.choices[0].text) for c in chunks if c.choices]
    assert {m for m, _ in pieces} == {"all-r8"}
    assert "".join(t for _, t in pieces) in ("alpha", "beta")
