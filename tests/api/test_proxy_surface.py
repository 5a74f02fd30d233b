"""The proxy's own surface beside its engines': ``/health`` names the model and sums the
engines' KV block pools (the seeds' ``block_pool``), ``/v1/gpu/info`` gathers every engine's
GPUs, and how a single-model server answers a ``model`` it does not serve."""

from __future__ import annotations

import httpx
import openai
import pytest

from ..proxy.utils import front_of, openai_client
from ..utils import wait_until

pytestmark = pytest.mark.timeout(300)


def _engine_urls(stack, which: str) -> list[str]:
    """The engines behind a front: the ``both`` engine, and for the P/D proxy its prefill."""
    both, _, pd = stack
    if which == "proxy":
        return [both.url]
    nodes = httpx.get(pd.url + "/nodes/status", headers=pd.headers_for("/nodes/"), timeout=10)
    return sorted(nodes.json())


@pytest.mark.parametrize("which", ["proxy", "proxy-pd"])
def test_proxy_health_names_the_model_and_sums_the_block_pools(stack, which: str) -> None:
    url, _ = front_of(stack, which)
    urls = _engine_urls(stack, which)
    total = sum(httpx.get(u + "/health").json()["block_pool"]["total_blocks"] for u in urls)

    def summed() -> bool:
        pool = httpx.get(url + "/health", timeout=10).json()["block_pool"]
        return pool["total_blocks"] == total and pool["free_blocks"] == total

    wait_until(summed, 30, "the proxy's block_pool to sum its idle engines'")
    h = httpx.get(url + "/health", timeout=10).json()
    assert h["model"] == "tiny" and h["models"] == ["tiny"] and h["status"] == "ok"
    assert h["block_pool"]["utilization"] == 0.0


@pytest.mark.parametrize("which", ["proxy", "proxy-pd"])
def test_gpu_info_through_the_proxy(stack, which: str) -> None:
    url, headers = front_of(stack, which)
    r = httpx.get(url + "/v1/gpu/info", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    urls = _engine_urls(stack, which)
    assert sorted(e["url"] for e in body["engines"]) == urls
    assert all(e["error"] is None for e in body["engines"])
    for u in urls:  # the same devices each engine reports itself (memory figures move)
        own = httpx.get(u + "/v1/gpu/info", timeout=10).json()["gpus"]
        via = [g for g in body["gpus"] if g["engine"] == u]
        assert [(g["id"], g["name"]) for g in via] == [(g["id"], g["name"]) for g in own]


@pytest.mark.parametrize("which", ["engine", "proxy", "proxy-pd"])
def test_a_model_the_server_does_not_serve(stack, which: str) -> None:
    """``default`` (ZSE's) and Ollama's ``:latest`` tag get the served model; any other
    name is a 404 naming what is served, never a silent swap to another model's answer."""
    client = openai_client(*front_of(stack, which))
    msgs = [{"role": "user", "content": "hi"}]
    for name in ("default", "tiny", "tiny:latest"):
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=2)
        assert r.choices[0].message.content is not None and r.model == "tiny", name
    with pytest.raises(openai.NotFoundError, match="tiny"):
        client.chat.completions.create(
            model="Meta-Llama-3-8B-Instruct", messages=msgs, max_tokens=2
        )
