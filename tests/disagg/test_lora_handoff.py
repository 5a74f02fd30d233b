"""P/D with LoRA adapters: the prefill's handle names the adapter its KV was computed
through, the decode engine continues through the same adapter (greedy tokens equal PEFT's),
and refuses a handle whose adapter the request does not name, or one it does not serve."""

from __future__ import annotations

import pytest

from tandem.server.disagg.transport import KVTransportClient, KVTransportServer
from tandem.server.engine import LLMEngine, SamplingParams
from tandem.server.engine.config import EngineConfig
from tandem.server.engine.sampling_params import InvalidParamError

from ..hf_reference import peft_greedy
from .utils import drain_one, run_pulls

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def lora_pd(tiny_models, tiny_loras):
    loras = tiny_loras["llama"]
    modules = tuple(f"{n}={p}" for n, p in loras.items())
    cfg = EngineConfig(
        model=str(tiny_models["llama"]), kv_cache_tokens=2048, block_size=8, lora_modules=modules
    )
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    bare = LLMEngine(cfg.replace(lora_modules=(), enable_lora=True))
    server = KVTransportServer(
        prefill.kv_cache, prefill.leased_blocks, prefill.release_lease, layout=prefill.kv_layout
    ).start()
    prefill.transport_address = server.address
    client = KVTransportClient(server.address, timeout_s=5)
    yield prefill, decode, bare, client
    client.close()
    server.close()


def _handle(prefill: LLMEngine, rid: str, prompt: list[int], lora: str | None) -> dict:
    prefill.add_request(rid, prompt, GREEDY, kv_transfer={"do_remote_decode": True}, lora=lora)
    out = drain_one(prefill, rid)
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def test_the_decode_engine_continues_through_the_prefills_adapter(
    lora_pd, tiny_models, tiny_loras
) -> None:
    prefill, decode, _, client = lora_pd
    prompt = list(range(5, 60))
    handle = _handle(prefill, "p", prompt, "all-r8")
    assert handle["lora_name"] == "all-r8"
    decode.add_request("d", prompt, GREEDY, kv_transfer=handle, lora="all-r8")
    decode.step()
    run_pulls(decode, client)
    out = drain_one(decode, "d")
    want = peft_greedy(tiny_models["llama"], tiny_loras["llama"], "all-r8", prompt, 12)
    assert out.token_ids == want and out.error is None
    assert "lora_name" not in _handle(prefill, "base", prompt, None)


def test_a_mismatched_or_missing_adapter_is_refused(lora_pd) -> None:
    prefill, decode, bare, _ = lora_pd
    prompt = list(range(5, 30))
    handle = _handle(prefill, "p", prompt, "qv-r4")
    for lora in (None, "all-r8"):
        with pytest.raises(InvalidParamError) as err:
            decode.add_request("d", prompt, GREEDY, kv_transfer=handle, lora=lora)
        assert err.value.param == "kv_transfer_params"
    with pytest.raises(InvalidParamError) as err:
        bare.add_request("d", prompt, GREEDY, kv_transfer=handle, lora="qv-r4")
    assert err.value.param == "model" and "qv-r4" in str(err.value)
    assert decode.stats().num_waiting == 0 and not decode.has_unfinished_requests()
