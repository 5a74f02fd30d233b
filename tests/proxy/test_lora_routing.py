"""LoRA adapters behind the proxy: requests for an adapter go only to the engines that have
it loaded (aggregated and P/D, greedy tokens equal PEFT's through the official ``openai``
client), and the proxy's ``/v1/models`` lists every adapter of its engines with its parent."""

from __future__ import annotations

import pytest

from ..hf_reference import peft_greedy
from ..utils import ENGINE_FLAGS, ServerProcess, greedy_token_ids
from .utils import ProxyProcess, engine_and_proxies, openai_client, stop_all

pytestmark = pytest.mark.timeout(300)
PROMPT_IDS = list(range(40, 90))
N = 8


def test_adapters_route_to_their_engines_aggregated_and_disaggregated(
    tiny_models, tiny_loras, tmp_path
) -> None:
    model, loras = tiny_models["llama"], tiny_loras["llama"]
    flags = (
        *ENGINE_FLAGS,
        "--lora-modules",
        f"qv-r4={loras['qv-r4']}",
        f"all-r8={loras['all-r8']}",
    )
    with engine_and_proxies(str(model), tmp_path, *flags) as (engine, aggregated, pd):
        for proxy in (aggregated, pd):
            client = openai_client(proxy.url, proxy.headers)
            listed = {m.id: m.model_extra.get("parent") for m in client.models.list()}
            assert listed == {"tiny": None, "qv-r4": "tiny", "all-r8": "tiny"}
            assert client.models.retrieve("all-r8").model_extra["parent"] == "tiny"
            for name in ("qv-r4", "all-r8"):
                assert greedy_token_ids(client, name, PROMPT_IDS, N) == peft_greedy(
                    model, loras, name, PROMPT_IDS, N
                )


def test_only_engines_with_the_adapter_get_its_requests(tiny_models, tiny_loras, tmp_path) -> None:
    model, loras = tiny_models["llama"], tiny_loras["llama"]
    with_it = ServerProcess(
        str(model),
        *ENGINE_FLAGS,
        "--lora-modules",
        f"ko-r2={loras['ko-r2']}",
        log_path=tmp_path / "with.log",
    )
    without = ServerProcess(str(model), *ENGINE_FLAGS, log_path=tmp_path / "without.log")
    proxy = ProxyProcess("--node", without.url, "--node", with_it.url, log_path=tmp_path / "p.log")
    try:
        with_it.wait_ready()
        without.wait_ready()
        nodes = proxy.wait_healthy([with_it.url, without.url])
        assert nodes[with_it.url]["lora_adapters"] == ["ko-r2"]
        client = openai_client(proxy.url, proxy.headers)
        want = peft_greedy(model, loras, "ko-r2", PROMPT_IDS, N)
        assert all(greedy_token_ids(client, "ko-r2", PROMPT_IDS, N) == want for _ in range(6))
        base = [greedy_token_ids(client, "tiny", PROMPT_IDS, N) for _ in range(2)]
        assert base[0] == base[1] != want
    finally:
        stop_all([proxy, with_it, without])
