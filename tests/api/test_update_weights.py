"""``POST /update_weights`` against a real ``tandem serve`` process, and what an aborted
non-streamed request answers (its partial output with true usage).

Two tiny models of the same shape and different seeds (A and B, the tokenizer is the same)
are saved to folders, and B also as a GGUF file; the server starts on A. Every greedy output
is checked token for token against transformers on the model that should be answering.
Requests are held in flight with ``/pause`` and ``/resume?steps=N``, never by timing.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import openai
import pytest
import torch

from ..engine.utils import write_gguf
from ..hf_reference import hf_greedy
from ..utils import (
    ADMIN_KEY,
    API_KEY,
    ENGINE_FLAGS,
    ServerProcess,
    held,
    serving,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps"
N = 8  # tokens per greedy comparison


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("weights")
    out = {
        name: str(make_tiny_model(str(root / name), spec))
        for name, spec in {
            "a": TinyModelSpec(seed=0),
            "b": TinyModelSpec(seed=1),
            "wide": TinyModelSpec(seed=0, intermediate_size=256),  # same KV, other MLP
        }.items()
    }
    write_gguf(Path(out["b"]), root / "b.gguf")
    out["b_gguf"] = str(root / "b.gguf")
    return out


@pytest.fixture(scope="module")
def server(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    with serving(
        ServerProcess(
            models["a"],
            *ENGINE_FLAGS,
            api_key=API_KEY,
            admin_key=ADMIN_KEY,
            log_path=tmp_path_factory.mktemp("weights-log") / "server.log",
            env={"TANDEM_CACHE": str(tmp_path_factory.mktemp("weights-cache"))},
        )
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(models: dict[str, str]) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["a"]).encode(PROMPT)


@pytest.fixture(scope="module")
def reference(models: dict[str, str], prompt_ids: list[int]) -> dict[str, list[int]]:
    """Transformers' greedy tokens of PROMPT on each model (HF folders)."""
    return {name: hf_greedy(Path(models[name]), prompt_ids, N)[0] for name in ("a", "b")}


def update(server: ServerProcess, key: str | None = ADMIN_KEY, **body: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/update_weights", json=body, headers=headers, timeout=120)


def greedy(client: openai.OpenAI, max_tokens: int = N) -> openai.types.Completion:
    return client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )


def generate_ids(server: ServerProcess) -> list[int]:
    """Greedy token ids of PROMPT through LMDeploy's /generate, which returns them."""
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"]


def switch_to(server: ServerProcess, path: str) -> dict:
    r = update(server, model_path=path)
    assert r.status_code == 200, r.text
    return r.json()["weights"]


def decode(models: dict[str, str], ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["a"]).decode(ids, skip_special_tokens=True)


# ----- /update_weights ---------------------------------------------------------------------
def test_update_swaps_the_answering_model_and_reports_its_identity(
    server: ServerProcess, client: openai.OpenAI, models, reference
) -> None:
    switch_to(server, models["a"])
    assert reference["a"] != reference["b"]
    assert generate_ids(server) == reference["a"]
    before = server.health()["weights"]
    weights = switch_to(server, models["b"])
    assert weights["path"] == models["b"] and weights["version"] == before["version"] + 1
    assert generate_ids(server) == reference["b"]
    assert greedy(client).choices[0].text == decode(models, reference["b"])
    health = server.health()
    assert health["weights"]["path"] == models["b"] and not health["weights"]["updating"]
    card = client.models.retrieve(MODEL)
    assert card.root == models["b"]
    assert card.model_extra["weights"]["version"] == weights["version"]
    listed = client.models.list().data[0]
    assert listed.root == models["b"]
    # Back to A, then B again from its GGUF file: the same tokens as B's folder.
    switch_to(server, models["a"])
    assert generate_ids(server) == reference["a"]
    weights = update(server, model_path=models["b_gguf"], weight_version="b-gguf").json()["weights"]
    assert weights["weight_version"] == "b-gguf" and weights["path"] == models["b_gguf"]
    assert generate_ids(server) == reference["b"]


def test_update_flushes_the_prefix_cache(
    server: ServerProcess, client: openai.OpenAI, models, reference
) -> None:
    switch_to(server, models["a"])
    greedy(client)
    warm = greedy(client)  # the prompt's full blocks come from the prefix cache
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    switch_to(server, models["b"])
    after = greedy(client)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert after.choices[0].text == decode(models, reference["b"])
    again = greedy(client)  # computed with B, cached again
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == decode(models, reference["b"])
    server.wait_idle()  # and no block leaked: every block is free


def test_weights_that_do_not_fit_are_refused_and_the_old_ones_keep_answering(
    server: ServerProcess, client: openai.OpenAI, models, reference, tmp_path: Path
) -> None:
    switch_to(server, models["a"])
    version = server.health()["weights"]["version"]
    r = update(server, model_path=models["wide"])
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "weights_mismatch" and "intermediate_size" in err["message"]
    assert update(server, model_path=str(tmp_path / "nowhere")).status_code == 404
    (tmp_path / "empty").mkdir()
    r = update(server, model_path=str(tmp_path / "empty"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_weights", r.text
    r = update(server, model_path=models["b"], load_format="gguf")
    assert r.status_code == 400, r.text
    r = update(server, model_path=models["b"], serialized_named_tensors="AAAA")
    assert r.status_code == 400, r.text
    assert server.health()["weights"]["version"] == version
    assert generate_ids(server) == reference["a"]


def test_a_client_key_cannot_update_weights(server: ServerProcess, models) -> None:
    before = server.health()["weights"]
    assert update(server, key=API_KEY, model_path=models["b"]).status_code == 403
    assert update(server, key=None, model_path=models["b"]).status_code == 401
    assert server.health()["weights"] == before


def _submit(
    pool: concurrent.futures.Executor,
    server: ServerProcess,
    client: openai.OpenAI,
    max_tokens: int,
    in_flight: int = 1,
) -> concurrent.futures.Future:
    """A greedy completion in ``pool``, returned once the server counts ``in_flight``."""
    fut = pool.submit(greedy, client, max_tokens)
    wait_until(lambda: _in_flight(server) == in_flight, what=f"{in_flight} requests in flight")
    return fut


def _in_flight(server: ServerProcess) -> int:
    h = server.health()
    return h["active_requests"] + h["pending_requests"]


def test_drain_lets_requests_in_flight_finish_on_the_old_weights(
    server: ServerProcess, client: openai.OpenAI, models, reference
) -> None:
    switch_to(server, models["a"])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        with held(server):
            old = _submit(pool, server, client, N)
            upd = pool.submit(update, server, model_path=models["b"])  # drain: true
            wait_until(lambda: server.health()["weights"]["updating"], what="the update waiting")
            new = _submit(pool, server, client, N, 2)  # waits for the drain, then runs on B
            assert not upd.done() and not old.done()
        assert upd.result().status_code == 200, upd.result().text
        assert old.result().choices[0].text == decode(models, reference["a"])
        assert new.result().choices[0].text == decode(models, reference["b"])
    assert server.health()["weights"]["path"] == models["b"]


def test_no_drain_aborts_requests_in_flight_with_their_partial_output(
    server: ServerProcess, client: openai.OpenAI, models, reference
) -> None:
    switch_to(server, models["a"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with held(server):
            old = _submit(pool, server, client, 64)
            _steps(server, 3)
            r = update(server, model_path=models["b"], drain=False)
            assert r.status_code == 200, r.text
            out = old.result()
    assert out.choices[0].finish_reason == "abort"
    assert out.usage.completion_tokens == 3
    assert out.choices[0].text == decode(models, reference["a"][:3])
    assert generate_ids(server) == reference["b"]
    server.wait_idle()


# ----- an aborted non-streamed request answers what it produced ---------------------------
def _steps(server: ServerProcess, n: int) -> None:
    """Let the held engine run exactly ``n`` steps (one token each here), then hold again."""
    r = httpx.post(
        server.url + "/resume", params={"steps": n}, headers=server.admin_headers, timeout=10
    )
    r.raise_for_status()
    wait_until(
        lambda: httpx.get(server.url + "/is_paused", headers=server.headers).json()["is_paused"],
        what=f"{n} steps run",
    )


def _abort_all(server: ServerProcess) -> int:
    r = httpx.post(
        server.url + "/abort_request",
        json={"abort_all": True},
        headers=server.admin_headers,
        timeout=10,
    )
    r.raise_for_status()
    return r.json()["aborted"]


@pytest.mark.parametrize("route", ["completions", "chat", "generate"])
def test_an_aborted_request_returns_its_partial_output_and_true_usage(
    server: ServerProcess, client: openai.OpenAI, models, route: str
) -> None:
    from transformers import AutoTokenizer

    switch_to(server, models["a"])
    tok = AutoTokenizer.from_pretrained(models["a"])
    if route == "chat":
        messages = [{"role": "user", "content": PROMPT}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(PROMPT)
    expected = hf_greedy(Path(models["a"]), ids, 5)[0]

    def call() -> tuple[str, list[int] | None, int, str]:
        if route == "completions":
            r = greedy(client, 200)
            return r.choices[0].text, None, r.usage.completion_tokens, r.choices[0].finish_reason
        if route == "chat":
            r = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=200,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            c = r.choices[0]
            return c.message.content, None, r.usage.completion_tokens, c.finish_reason
        body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=120)
        meta = r.json()["meta_info"]
        return (
            r.json()["text"],
            r.json()["output_ids"],
            meta["completion_tokens"],
            meta["finish_reason"]["type"],
        )

    with concurrent.futures.ThreadPoolExecutor(1) as pool, held(server):
        fut = pool.submit(call)
        wait_until(lambda: _in_flight(server) == 1, what="the request admitted")
        _steps(server, 5)
        assert _abort_all(server) == 1
        text, output_ids, completion_tokens, finish = fut.result()
    assert finish == "abort"
    assert completion_tokens == 5
    assert text == tok.decode(expected, skip_special_tokens=True) and text
    if output_ids is not None:
        assert output_ids == expected
    server.wait_idle()


# ----- through the proxy: every engine of the model -----------------------------------------
def test_the_proxy_updates_every_engine_and_only_for_the_admin(
    models, reference, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from ..proxy.utils import PROXY_ADMIN_KEY, PROXY_KEY, ProxyProcess, stop_all

    logs = tmp_path_factory.mktemp("weights-proxy")
    engines = [
        ServerProcess(models["a"], *ENGINE_FLAGS, log_path=logs / f"engine{i}.log")
        for i in range(2)
    ]
    proxy = ProxyProcess(*[a for e in engines for a in ("--node", e.url)], log_path=logs / "p.log")
    try:
        for e in engines:
            e.wait_ready()
        proxy.wait_healthy([e.url for e in engines])

        def at_proxy(key: str, **body: object) -> httpx.Response:
            return httpx.post(
                proxy.url + "/update_weights",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )

        assert at_proxy(PROXY_KEY, model_path=models["b"]).status_code == 403
        r = at_proxy(PROXY_ADMIN_KEY, model_path=models["wide"], model=MODEL)
        assert r.status_code == 409 and r.json()["error"]["code"] == "weights_mismatch", r.text
        assert [e.health()["weights"]["path"] for e in engines] == [models["a"]] * 2
        r = at_proxy(PROXY_ADMIN_KEY, model_path=models["b"], model=MODEL)
        assert r.status_code == 200, r.text
        assert sorted(x["url"] for x in r.json()["results"]) == sorted(e.url for e in engines)
        assert [e.health()["weights"]["path"] for e in engines] == [models["b"]] * 2
        for e in engines:
            assert generate_ids(e) == reference["b"]
        body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
        via = httpx.post(proxy.url + "/generate", json=body, headers=proxy.headers, timeout=120)
        assert via.json()["output_ids"] == reference["b"]
    finally:
        stop_all([proxy, *engines])


# ----- the engine itself --------------------------------------------------------------------
def _run(engine, rid: str, prompt: list[int], n: int = N, **kw: object) -> list[int]:
    from tandem.server.engine import SamplingParams

    engine.add_request(
        rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), **kw
    )
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done[rid].outputs[0].token_ids


def test_the_engine_drops_every_block_the_old_weights_computed(
    models, reference, prompt_ids
) -> None:
    from tandem.server.engine import EngineBusyError, EngineSleepingError, LLMEngine, SamplingParams
    from tandem.server.engine.config import EngineConfig
    from tandem.server.engine.models.config import WeightsMismatchError

    engine = LLMEngine(
        EngineConfig(model=models["a"], device="cpu", kv_cache_tokens=2048, max_model_len=256)
    )
    assert _run(engine, "cached", prompt_ids) == reference["a"]
    _run(engine, "turn", prompt_ids, session_id="s")
    _run(engine, "prefill", prompt_ids, 1, kv_transfer={"do_remote_decode": True})
    pool = engine.kv.pool
    assert pool.num_cached > 0 and len(engine.sessions) == 1 and len(engine.handoff.leases) == 1
    with pytest.raises(WeightsMismatchError):
        engine.update_weights(models["wide"])
    assert _run(engine, "still-a", prompt_ids) == reference["a"]
    engine.add_request("busy", prompt_ids, SamplingParams(max_tokens=4))
    with pytest.raises(EngineBusyError):
        engine.update_weights(models["b"])
    engine.abort_request("busy")
    assert engine.update_weights(models["b"], "v2").version == 1
    assert pool.num_cached == 0 and len(engine.sessions) == 0 and len(engine.handoff.leases) == 0
    pool.check_all_free()
    assert _run(engine, "b", prompt_ids) == reference["b"]
    engine.sleep(2)  # weights dropped: waking reloads the updated ones, not the first
    with pytest.raises(EngineSleepingError):
        engine.update_weights(models["a"])
    engine.wake_up()
    assert _run(engine, "woken", prompt_ids) == reference["b"]
    engine.close()


def test_every_tensor_parallel_rank_loads_the_new_weights(models, reference, prompt_ids) -> None:
    from tandem.server.engine import LLM, SamplingParams

    llm = LLM(models["a"], tensor_parallel_size=2, device="cpu", kv_cache_tokens=2048)
    procs = list(llm.engine.worker._ranks.procs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
        assert llm.generate([prompt_ids], params)[0].token_ids == reference["a"]
        llm.engine.update_weights(models["b"])
        assert llm.generate([prompt_ids], params)[0].token_ids == reference["b"]
    finally:
        llm.engine.worker.close()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_cuda_graphs_run_the_new_weights(tmp_path, prompt_ids) -> None:
    """The swap copies into the parameters in place, so decode steps replayed from graphs
    captured on A's weights compute with B's: the same tokens as an engine started on B
    (bfloat16 through FlashInfer, the path that captures graphs)."""
    from dataclasses import replace

    from tandem.server.engine import LLM, SamplingParams
    from tandem.server.engine.tiny_model import make_tiny_model

    from ..model_specs import GPU_SPECS

    a, b = (
        str(make_tiny_model(tmp_path / name, replace(GPU_SPECS["llama"], seed=seed)))
        for name, seed in (("a", 0), ("b", 1))
    )
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_tokens=2048)
    fresh = LLM(b, **kw)
    expected = fresh.generate([prompt_ids], params)[0].token_ids
    fresh.engine.close()
    del fresh
    llm = LLM(a, **kw)
    assert llm.engine.worker.runner.graph_sizes
    assert llm.generate([prompt_ids], params)[0].token_ids != expected
    llm.engine.update_weights(b)
    assert llm.generate([prompt_ids], params)[0].token_ids == expected
    llm.engine.close()


def test_health_shows_the_weights_path_to_operators_only(server) -> None:
    """``/health`` takes no key: an anonymous caller of a keyed server sees the weights'
    version, not where they lie on the engine's filesystem; the admin sees the path."""
    anonymous = httpx.get(server.url + "/health", timeout=10).json()["weights"]
    assert "path" not in anonymous and anonymous["version"] >= 0
    assert server.health()["weights"]["path"].startswith("/")
    client = httpx.get(server.url + "/health", headers=server.headers, timeout=10).json()
    assert "path" not in client["weights"]
