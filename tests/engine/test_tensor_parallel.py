"""Tensor parallelism on CPU: two gloo ranks give the same greedy tokens as one.

The tiny models have 4 query heads and 2 KV heads, so each rank holds 2 and 1; Qwen2 adds
sharded q/k/v biases and Qwen3 per-head q/k norms. The second rank is a spawned process: it
must be gone after every test, passed or failed.
"""

from __future__ import annotations

import pytest
import torch

from tandem.server.engine import LLM, SamplingParams
from tandem.server.engine.loader import load_model, read_model_config
from tandem.server.engine.parallel import TensorParallel, TensorParallelError
from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

PROMPTS = [[5, 17, 99, 300, 41], list(range(40, 90)), [7, 8] * 15]
ENGINE = dict(
    device="cpu", kv_cache_tokens=2048, max_num_batched_tokens=32
)  # 32: chunked prefill too


@pytest.fixture
def tp_llm():
    """Yields a factory; every engine it made is closed (its ranks joined or killed) afterwards."""
    made: list[LLM] = []

    def make(model_dir, **kw) -> LLM:
        llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        procs = list(llm.engine.worker._ranks.procs) if llm.engine.worker._ranks else []
        llm.engine.worker.close()
        assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_equal_one(tiny_models, tp_llm, arch: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(tiny_models[arch]), **ENGINE).generate(PROMPTS, params)]
    assert len({t for ids in ref for t in ids}) > 10  # varied output, or equality proves little
    llm = tp_llm(tiny_models[arch])
    assert llm.engine.worker.tensor_parallel_size == 2
    assert llm.engine.kv_cache.num_kv_heads == 1
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref


def test_sleep_and_wake_reach_every_rank(tiny_models, tp_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = tp_llm(tiny_models["llama"])
    before = [o.token_ids for o in llm.generate(PROMPTS[:1], params)]
    llm.engine.sleep(2)
    llm.engine.wake_up()
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], params)] == before


def test_shards_split_heads_and_rows(tiny_models) -> None:
    """Rank r holds rows r of each packed shard and columns r of the row-parallel layers."""
    d = tiny_models["qwen2"]
    full = load_model(d, torch.float32, torch.device("cpu"))
    cfg = read_model_config(d)
    hd = cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    for rank in (0, 1):
        part = load_model(d, torch.float32, torch.device("cpu"), TensorParallel(rank=rank, size=2))
        fa, pa = full.model.layers[0].self_attn, part.model.layers[0].self_attn
        w = fa.qkv_proj.weight
        want = torch.cat(
            [w[:q].chunk(2)[rank], w[q : q + kv].chunk(2)[rank], w[q + kv :].chunk(2)[rank]]
        )
        assert torch.equal(pa.qkv_proj.weight, want)
        b = fa.qkv_proj.bias
        assert torch.equal(
            pa.qkv_proj.bias,
            torch.cat(
                [b[:q].chunk(2)[rank], b[q : q + kv].chunk(2)[rank], b[q + kv :].chunk(2)[rank]]
            ),
        )
        assert torch.equal(pa.o_proj.weight, fa.o_proj.weight.chunk(2, dim=1)[rank])
        fm, pm = full.model.layers[0].mlp, part.model.layers[0].mlp
        i = cfg.intermediate_size
        gu = fm.gate_up_proj.weight
        assert torch.equal(
            pm.gate_up_proj.weight, torch.cat([gu[:i].chunk(2)[rank], gu[i:].chunk(2)[rank]])
        )
        assert torch.equal(pm.down_proj.weight, fm.down_proj.weight.chunk(2, dim=1)[rank])
        assert torch.equal(part.lm_head.weight, full.lm_head.weight)  # replicated


def test_indivisible_heads_are_a_clear_error(tmp_path) -> None:
    d = make_tiny_model(tmp_path / "m", TinyModelSpec(num_attention_heads=4, num_key_value_heads=1))
    with pytest.raises(TensorParallelError, match="num_key_value_heads"):
        load_model(d, torch.float32, torch.device("cpu"), TensorParallel(rank=0, size=2))
