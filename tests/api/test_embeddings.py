"""Embeddings and pooling (docs/pooling.md): exact against transformers' final hidden states,
scheduled with generation, served by ``tandem serve`` and through the proxy in both modes."""

from __future__ import annotations

import base64
import json
import struct
import threading
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.server.engine import LLM, PoolingParams, SamplingParams
from tandem.server.engine.default_model import default_model_path

from ..hf_reference import hf_greedy, hf_model
from ..proxy.utils import FRONTS, engine_and_proxies, front_of, openai_client
from ..utils import ENGINE_FLAGS, held, wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
TEXTS = ["The quick brown fox jumps over the lazy dog", "hello", "Once upon a time " * 12]
MIN_COSINE = 0.9999


def hf_hidden(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden states ``[len(ids), hidden]`` (float32)."""
    with torch.no_grad():
        return hf_model(str(model_dir)).model(torch.tensor([ids])).last_hidden_state[0]


def pooled(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]


def cosine(a: list[float] | torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a), b, dim=0).item()


def free_blocks_all_back(llm: LLM) -> bool:
    stats = llm.engine.stats()
    return stats.free_blocks == stats.total_blocks and stats.num_running == stats.num_waiting == 0


# ----- the engine, in process ----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_pooling_modes_equal_transformers(tiny_models: dict[str, Path], arch: str) -> None:
    """last/mean/cls (chunked prefill: 16-token steps; prefix-cache hits for ``last``)
    equal transformers' hidden states, normalised and raw; no block stays held."""
    model_dir = tiny_models[arch]
    llm = LLM(str(model_dir), kv_cache_tokens=2048, block_size=16, max_num_batched_tokens=16)
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, ids)) > 48  # at least four chunks
    for kind in ("last", "mean", "cls"):
        refs = [pooled(hf_hidden(model_dir, i), kind) for i in ids]
        for _ in range(2):  # the second time, ``last`` finds the prompts in the prefix cache
            vecs = llm.embed(TEXTS, PoolingParams(kind))
            for vec, ref in zip(vecs, refs):
                assert cosine(vec, ref) >= MIN_COSINE, (arch, kind)
                assert abs(torch.tensor(vec).norm().item() - 1.0) < 1e-5
        raw = llm.embed(ids, PoolingParams(kind, normalize=False))
        for vec, ref in zip(raw, refs):
            torch.testing.assert_close(torch.tensor(vec), ref, rtol=1e-4, atol=1e-4)
    assert free_blocks_all_back(llm)


def test_embedding_and_generation_share_one_step(llama_dir: Path) -> None:
    """An embedding and a generation in the same engine step: the embedding finishes in it,
    the generation samples its first token in it, and its greedy output is unchanged."""
    llm = LLM(str(llama_dir), kv_cache_tokens=2048, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    prompt = llm.tokenizer.encode("In the beginning")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("gen", prompt, greedy)
    engine.add_request("emb", TEXTS[0], SamplingParams(), pooling=PoolingParams())
    first = {o.request_id: o for o in engine.step()}
    assert first["emb"].finished and first["emb"].embedding is not None
    assert len(engine.scheduler.running) == 1  # the embedding left; the generation goes on
    assert len(engine.scheduler.running[0].output_token_ids) == 1  # sampled in that same step
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "gen" and out.finished:
                tokens = out.token_ids
    assert tokens == hf_greedy(llama_dir, prompt, 12)[0]
    assert (
        cosine(
            first["emb"].embedding,
            pooled(hf_hidden(llama_dir, first["emb"].prompt_token_ids), "last"),
        )
        >= MIN_COSINE
    )
    assert free_blocks_all_back(llm)


def test_a_preempted_embedding_starts_over(llama_dir: Path) -> None:
    """Six usable blocks: a generation holding three that grows to five, and a chunked
    mean-pooled embedding of four arriving meanwhile. The embedding is preempted, recomputes
    from its first token (its partial sum dropped) and still equals transformers."""
    llm = LLM(
        str(llama_dir),
        kv_cache_tokens=96,
        block_size=16,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    gen_ids = llm.tokenizer.encode("In the beginning " * 8)[:20]
    emb_ids = llm.tokenizer.encode("Once upon a time " * 20)[:60]
    assert len(gen_ids) == 20 and len(emb_ids) == 60
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("gen", gen_ids, greedy)
    while engine.scheduler.running[:1] == [] or engine.scheduler.running[0].num_tokens < 44:
        engine.step()
    engine.add_request("emb", emb_ids, SamplingParams(), pooling=PoolingParams("mean"))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.stats().num_preemptions > 0
    assert done["gen"].token_ids == hf_greedy(llama_dir, gen_ids, 60)[0]
    ref = pooled(hf_hidden(llama_dir, emb_ids), "mean")
    assert cosine(done["emb"].embedding, ref) >= MIN_COSINE
    assert free_blocks_all_back(llm)


def test_embeddings_under_tensor_parallelism(llama_dir: Path) -> None:
    """Two CPU ranks: rank 0's replicated final norm gives the same vectors."""
    llm = LLM(str(llama_dir), tensor_parallel_size=2, device="cpu", kv_cache_tokens=2048)
    try:
        for kind in ("last", "mean"):
            vecs = llm.embed(TEXTS, PoolingParams(kind))
            for text, vec in zip(TEXTS, vecs):
                ref = pooled(hf_hidden(llama_dir, llm.tokenizer.encode(text)), kind)
                assert cosine(vec, ref) >= MIN_COSINE
    finally:
        llm.engine.worker.close()


def test_dimensions_truncate_only_a_matryoshka_model(tmp_path: Path, llama_dir: Path) -> None:
    """A model whose config.json declares Matryoshka dimensions is truncated, then normalised;
    any other model serves only its full hidden size (the API's 400)."""
    from tandem.server.engine import InvalidParamError

    plain = LLM(str(llama_dir), kv_cache_tokens=1024)
    hidden = plain.engine.model_config.hidden_size
    full = plain.embed(TEXTS[0], PoolingParams(dimensions=hidden))[0]
    assert len(full) == hidden
    with pytest.raises(InvalidParamError, match="Matryoshka"):
        plain.embed(TEXTS[0], PoolingParams(dimensions=8))

    mat = tmp_path / "matryoshka"
    mat.mkdir()
    for f in llama_dir.iterdir():
        (mat / f.name).symlink_to(f)
    config = json.loads((llama_dir / "config.json").read_text())
    (mat / "config.json").unlink()
    (mat / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16]}))
    llm = LLM(str(mat), kv_cache_tokens=1024)
    ref = pooled(hf_hidden(llama_dir, llm.tokenizer.encode(TEXTS[0])), "last")
    vec = llm.embed(TEXTS[0], PoolingParams(dimensions=8))[0]
    assert len(vec) == 8 and cosine(vec, ref[:8]) >= MIN_COSINE
    assert abs(torch.tensor(vec).norm().item() - 1.0) < 1e-5
    with pytest.raises(InvalidParamError, match=r"\[8, 16\]"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=12))


def test_default_model_smollm2_embeddings_equal_transformers() -> None:
    """The default real model (Q4_1 GGUF), last-token pooling against transformers' own
    GGUF loading in float32."""
    path = default_model_path()
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    llm = LLM(str(path), kv_cache_tokens=2048, dtype="float32")
    vecs = llm.embed(TEXTS)
    for text, vec in zip(TEXTS, vecs):
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            hidden = ref_model.model(torch.tensor([ids])).last_hidden_state[0]
        assert cosine(vec, hidden[-1]) >= MIN_COSINE
    assert free_blocks_all_back(llm)


# ----- tandem serve, and the proxy in front of it ---------------------------------------------
@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    """A ``both`` engine and a prefill engine, both ``--pooling mean``; a proxy over the first
    (aggregated) and one over both (P/D)."""
    logs = tmp_path_factory.mktemp("embeddings")
    with engine_and_proxies(str(llama_dir), logs, *ENGINE_FLAGS, "--pooling", "mean") as stack:
        yield stack


@pytest.fixture(params=FRONTS)
def front(request, stack):
    return front_of(stack, request.param)


def test_openai_client_embeddings_equal_transformers(front, llama_dir: Path) -> None:
    """``embeddings.create`` with texts (the client asks for base64 and decodes it), token
    ids and lists of them, and float encoding: the ``--pooling mean`` vectors of transformers."""
    url, headers = front
    client = openai_client(url, headers)
    ids = _token_ids(url, headers, TEXTS)
    refs = [pooled(hf_hidden(llama_dir, i), "mean") for i in ids]

    r = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, ref in zip(r.data, refs):
        assert cosine(d.embedding, ref) >= MIN_COSINE

    as_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    text = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    for vec in (as_ids.data[0].embedding, one.data[0].embedding, text.data[0].embedding):
        assert cosine(vec, refs[0]) >= MIN_COSINE
    assert one.usage.prompt_tokens == len(ids[0])


def test_base64_pooling_dimensions_and_normalize(front) -> None:
    """One input per request, so each runs alone in its steps and the vectors compare
    bit for bit (two inputs may or may not share a step: float sums then differ in the
    last bits)."""
    url, headers = front
    body = {"model": MODEL, "input": [TEXTS[0]]}
    floats = _post(url, headers, "/v1/embeddings", {**body, "encoding_format": "float"})
    b64 = _post(url, headers, "/v1/embeddings", {**body, "encoding_format": "base64"})
    for f, b in zip(floats["data"], b64["data"]):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]
        assert b["object"] == "embedding"

    pool = _post(url, headers, "/pooling", {**body, "encoding_format": "float"})
    assert pool["object"] == "list" and pool["usage"] == floats["usage"]
    assert [(d["index"], d["object"]) for d in pool["data"]] == [(0, "pooling")]
    assert [d["data"] for d in pool["data"]] == [d["embedding"] for d in floats["data"]]

    hidden = len(floats["data"][0]["embedding"])
    same = _post(url, headers, "/v1/embeddings", {**body, "dimensions": hidden})
    assert [d["embedding"] for d in same["data"]] == [d["embedding"] for d in floats["data"]]
    r = httpx.post(url + "/v1/embeddings", json={**body, "dimensions": 8}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"

    raw = _post(url, headers, "/v1/embeddings", {**body, "normalize": False})
    vec = torch.tensor(raw["data"][0]["embedding"])
    assert abs(vec.norm().item() - 1.0) > 1e-3
    assert cosine(floats["data"][0]["embedding"], vec) >= MIN_COSINE


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1.5, 2]}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": [1] * 513}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)
def test_bad_input_is_a_4xx_and_leaks_no_block(stack, body: dict, param: str) -> None:
    both, aggregated, _ = stack
    for target in (both, aggregated):
        for path in ("/v1/embeddings", "/pooling"):
            r = httpx.post(target.url + path, json=body, headers=target.headers, timeout=30)
            want = 404 if param == "model" else 400
            assert r.status_code == want, (path, r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"]
            if param != "model":
                assert param in (error.get("param") or "") or param in error["message"]
    both.wait_idle()


def test_an_input_filling_the_context_is_served(stack) -> None:
    """An embedding generates nothing, so its input may fill the whole context (512)."""
    both, _, _ = stack
    r = _post(both.url, both.headers, "/v1/embeddings", {"input": [[5] * 512]})
    assert r["usage"]["prompt_tokens"] == 512
    both.wait_idle()


def _post(url: str, headers: dict[str, str], path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _token_ids(url: str, headers: dict[str, str], texts: list[str]) -> list[list[int]]:
    return [_post(url, headers, "/tokenize", {"prompt": t})["tokens"] for t in texts]


def test_openapi_documents_both_routes(stack) -> None:
    both, _, _ = stack
    spec = httpx.get(both.url + "/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/embeddings", "EmbeddingRequest"), ("/pooling", "PoolingRequest")):
        post = spec["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model) and {"200", "400"} <= set(post["responses"])
        fields = {"input", "model", "encoding_format", "dimensions", "user", "normalize"}
        assert fields <= set(schemas[model]["properties"])


def test_an_aborted_embedding_is_a_503_and_frees_its_blocks(stack) -> None:
    """Held in flight (the engine paused), then ``/abort_request`` with ``abort_all``: no
    vector exists, so the answer is a retryable 503, and every block is back."""
    both, _, _ = stack
    with httpx.Client(timeout=60) as c:
        with held(both):
            result: dict = {}
            t = threading.Thread(
                target=lambda: result.update(
                    r=c.post(
                        both.url + "/v1/embeddings", json={"input": TEXTS}, headers=both.headers
                    )
                )
            )
            t.start()
            wait_until(
                lambda: both.health()["active_requests"] + both.health()["pending_requests"] == 3
            )

            def aborted() -> bool:
                a = httpx.post(
                    both.url + "/abort_request",
                    json={"abort_all": True},
                    headers=both.admin_headers,
                )
                return a.status_code == 200 and a.json()["aborted"] > 0

            wait_until(aborted, what="the embeddings were aborted")
        t.join()
    r = result["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_aborted"
    both.wait_idle()


def test_more_inputs_than_the_waiting_queue_admits(stack) -> None:
    """300 inputs (the engine admits 256 waiting requests) are served in waves, in order."""
    both, _, _ = stack
    inputs = [[5 + i % 50, 6, 7] for i in range(300)]
    r = _post(both.url, both.headers, "/v1/embeddings", {"input": inputs})
    assert [d["index"] for d in r["data"]] == list(range(300))
    assert r["usage"]["prompt_tokens"] == 900
    vec = [torch.tensor(r["data"][i]["embedding"]) for i in (0, 50, 1)]
    assert cosine(vec[0], vec[1]) >= MIN_COSINE > cosine(vec[0], vec[2])  # same input, same vector
    both.wait_idle()
