"""Multi-LoRA: greedy outputs through PEFT adapters equal PEFT + transformers token for
token, in batches mixing the base model and several adapters, cold, with prefix hits, under
preemption, chunked prefill, n > 1, sessions and fewer slots than adapters; the adapter is
part of the prefix-cache hash; malformed adapters are refused and the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.server.engine import LLM, SamplingParams
from tandem.server.engine.lora.adapter import LoraLoadError, LoraPair
from tandem.server.engine.lora.segment import (
    add_lora,
    add_lora_stacked,
    plan_segments,
    row_weights,
    stack_pairs,
)
from tandem.server.engine.sampling_params import InvalidParamError

from ..hf_reference import peft_greedy
from .utils import PROMPTS, drain

NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
NAMES = ["qv-r4", "all-r8", "mlp-r16", "ko-r2"]


def _modules(loras: dict[str, Path]) -> tuple[str, ...]:
    return tuple(f"{name}={path}" for name, path in loras.items())


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def case(request: pytest.FixtureRequest, tiny_models, tiny_loras):
    """An engine serving every adapter, the prompts, and PEFT's greedy tokens per (adapter,
    prompt); None is the base model."""
    arch = request.param
    model_dir, loras = tiny_models[arch], tiny_loras[arch]
    llm = LLM(str(model_dir), kv_cache_tokens=16384, block_size=16, lora_modules=_modules(loras))
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = {
        (name, i): peft_greedy(model_dir, loras, name, p, NEW)
        for name in [None, *NAMES]
        for i, p in enumerate(ids)
    }
    return model_dir, loras, llm, ids, expected


def _mixed(ids: list[list[int]]) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt through the base and every adapter, interleaved in one batch."""
    names = [None, *NAMES]
    pairs = [(names[(i + j) % len(names)], i) for j in range(len(names)) for i in range(len(ids))]
    return [ids[i] for _, i in pairs], [n for n, _ in pairs]


def _check(outputs, prompts, names, ids, expected) -> None:
    for out, prompt, name in zip(outputs, prompts, names):
        want = expected[(name, ids.index(prompt))]
        assert out.token_ids == want, f"{name}: engine {out.token_ids} != peft {want}"


def test_adapters_change_the_outputs(case) -> None:
    """Otherwise every equality below could hold with the adapters ignored."""
    _, _, _, ids, expected = case
    for name in NAMES:
        differ = sum(expected[(name, i)] != expected[(None, i)] for i in range(len(ids)))
        assert differ >= len(ids) - 1, name
        assert any(len(set(expected[(name, i)])) >= 4 for i in range(len(ids))), name


def test_mixed_batch_matches_peft_cold_and_with_prefix_hits(case) -> None:
    _, _, llm, ids, expected = case
    prompts, names = _mixed(ids)
    llm.engine.kv.pool.reset_prefix_cache()
    _check(llm.generate(prompts, GREEDY, lora=names), prompts, names, ids, expected)
    warm = llm.generate(prompts, GREEDY, lora=names)
    assert sum(o.num_cached_tokens for o in warm) > 0
    _check(warm, prompts, names, ids, expected)


def test_the_adapter_is_part_of_the_prefix_cache_hash(case) -> None:
    """The same long prompt through adapter A, then B: B computes it all again (no block of
    A's is hit) and still equals PEFT; through A again, it hits. Leaving the adapter out of
    the block hash makes B hit A's KV and fails this test."""
    _, _, llm, ids, expected = case
    long = ids.index(max(ids, key=len))
    assert len(ids[long]) > 32
    llm.engine.kv.pool.reset_prefix_cache()
    seen = []
    for name in ["qv-r4", "all-r8", None, "ko-r2", "qv-r4"]:
        out = llm.generate([ids[long]], GREEDY, lora=name)[0]
        assert out.token_ids == expected[(name, long)], name
        seen.append(out.num_cached_tokens)
    assert seen[:4] == [0, 0, 0, 0]
    assert seen[4] > 0


def test_fewer_slots_than_adapters_wait_and_match(case) -> None:
    """max_loras=2 with four adapters in one batch: requests whose adapter cannot be
    resident wait (none fails), slots are reused (least recently used first)."""
    model_dir, loras, _, ids, expected = case
    llm = LLM(
        str(model_dir),
        kv_cache_tokens=8192,
        block_size=16,
        lora_modules=_modules(loras),
        max_loras=2,
    )
    peak = []
    admissible = llm.engine.scheduler.admissible

    def watch(req, running):
        ok = admissible(req, running)
        peak.append(
            len(
                {r.lora.name for r in running if r.lora}
                | ({req.lora.name} if ok and req.lora else set())
            )
        )
        return ok

    llm.engine.scheduler.admissible = watch
    prompts, names = _mixed(ids)
    _check(llm.generate(prompts, GREEDY, lora=names), prompts, names, ids, expected)
    assert max(peak) == 2
    assert llm.engine.loras.loads > 2
    llm.engine.kv.pool.check_all_free()


def test_preemption_and_chunked_prefill_with_adapters(case) -> None:
    model_dir, loras, _, ids, expected = case
    prompts, names = _mixed(ids)
    tokens = max(len(p) for p in ids) + NEW + 16
    small = LLM(
        str(model_dir),
        kv_cache_tokens=tokens,
        block_size=8,
        max_num_seqs=8,
        lora_modules=_modules(loras),
    )
    _check(small.generate(prompts, GREEDY, lora=names), prompts, names, ids, expected)
    assert small.engine.stats().num_preemptions > 0
    chunked = LLM(
        str(model_dir),
        kv_cache_tokens=8192,
        block_size=4,
        max_num_batched_tokens=7,
        lora_modules=_modules(loras),
    )
    _check(chunked.generate(prompts, GREEDY, lora=names), prompts, names, ids, expected)


def test_n_greater_than_one_runs_every_choice_through_the_adapter(case) -> None:
    _, _, llm, ids, expected = case
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, n=3)
    out = llm.generate([ids[1]], params, lora="all-r8")[0]
    assert [c.token_ids for c in out.outputs] == [expected[("all-r8", 1)]] * 3


def test_a_session_turn_through_another_adapter_does_not_reuse_its_blocks(case) -> None:
    _, _, llm, ids, expected = case
    engine = llm.engine
    for turn, name in enumerate(["qv-r4", "mlp-r16", "mlp-r16"]):
        rid = f"session-turn-{turn}"
        engine.add_request(rid, ids[6], GREEDY, session_id="s-lora", lora=name)
        out = _finish(engine, rid)
        assert out.outputs[0].token_ids == expected[(name, 6)]
        if turn == 1:
            assert out.num_cached_tokens == 0
    assert engine.delete_session("s-lora")


def _finish(engine, rid):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_unknown_adapter_is_refused(case) -> None:
    _, _, llm, ids, _ = case
    with pytest.raises(InvalidParamError) as err:
        llm.engine.add_request("x", ids[0], GREEDY, lora="nope")
    assert err.value.param == "model"


def _broken(src: Path, dst: Path, how: str) -> Path:
    """A copy of the adapter at ``src`` broken one way."""
    if how == "missing":
        return dst
    shutil.copytree(src, dst)
    config, weights = dst / "adapter_config.json", dst / "adapter_model.safetensors"
    if how == "no-weights":
        weights.unlink()
    elif how == "bad-json":
        config.write_text("{")
    elif how == "rank":
        config.write_text(json.dumps({**json.loads(config.read_text()), "r": 128}))
    elif how == "dora":
        config.write_text(json.dumps({**json.loads(config.read_text()), "use_dora": True}))
    elif how == "shape":
        cut = {k: v[..., :-1].contiguous() for k, v in load_file(str(weights)).items()}
        save_file(cut, str(weights))
    elif how == "not-safetensors":
        weights.write_bytes(b"not a safetensors file")
    return dst


BROKEN = ["missing", "no-weights", "bad-json", "rank", "dora", "shape", "not-safetensors"]


def test_malformed_adapters_are_refused_and_the_engine_keeps_serving(
    case, tiny_loras, tmp_path: Path
) -> None:
    _, loras, llm, ids, expected = case
    engine = llm.engine
    paths = [_broken(loras["qv-r4"], tmp_path / how, how) for how in BROKEN]
    # an adapter made for another base: qwen3's tiny model has another head_dim
    arch = "qwen3" if "qwen3" not in str(loras["all-r8"]) else "llama"
    paths.append(tiny_loras[arch]["all-r8"])
    for i, path in enumerate(paths):
        with pytest.raises(LoraLoadError):
            engine.add_lora(engine.read_lora(f"bad-{i}", str(path)))
    assert list(engine.served_loras) == NAMES
    with pytest.raises(LoraLoadError):  # one name, one adapter
        engine.add_lora(engine.read_lora("qv-r4", str(loras["qv-r4"])))
    out = llm.generate([ids[0]], GREEDY, lora="qv-r4")[0]
    assert out.token_ids == expected[("qv-r4", 0)]


def test_load_and_unload_at_run_time(case) -> None:
    _, loras, llm, ids, expected = case
    engine = llm.engine
    engine.add_lora(engine.read_lora("late", str(loras["ko-r2"])))
    assert llm.generate([ids[2]], GREEDY, lora="late")[0].token_ids == expected[("ko-r2", 2)]
    assert engine.remove_lora("late") and not engine.remove_lora("late")
    with pytest.raises(InvalidParamError):
        engine.add_request("gone", ids[2], GREEDY, lora="late")


def test_a_replaced_adapter_serves_new_requests_and_finishes_running_ones(case) -> None:
    _, loras, llm, ids, expected = case
    engine = llm.engine
    engine.add_lora(engine.read_lora("swap", str(loras["qv-r4"])))
    engine.add_request("old", ids[1], GREEDY, lora="swap")
    engine.step()  # "old" was bound to qv-r4 when added; now it is running
    engine.add_lora(engine.read_lora("swap", str(loras["mlp-r16"])), replace=True)
    assert engine.served_loras["swap"] == str(loras["mlp-r16"])
    engine.add_request("new", ids[1], GREEDY, lora="swap")
    done = drain(engine)
    assert done["old"].outputs[0].token_ids == expected[("qv-r4", 1)]
    assert done["new"].outputs[0].token_ids == expected[("mlp-r16", 1)]
    assert engine.remove_lora("swap")


def test_segments_group_rows_by_slot() -> None:
    plan = plan_segments([0, -1, 1, 0, 0], [3, 2, 1, 2, 1], torch.device("cpu"))
    assert plan.slots == [0, 1]
    assert plan.rows[0].tolist() == [0, 1, 2, 6, 7, 8]
    assert plan.rows[1] == slice(5, 6)
    assert plan_segments([-1, -1], [4, 1], torch.device("cpu")) is None
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.zeros(9, 3, dtype=torch.float64)
    pairs = [
        LoraPair(torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64))
        for _ in range(2)
    ]
    add_lora(x, y, plan, [(pairs[0], 0.5), (pairs[1], 2.0)])
    want = torch.zeros(9, 3, dtype=torch.float64)
    for rows, (p, s) in zip([[0, 1, 2, 6, 7, 8], [5]], [(pairs[0], 0.5), (pairs[1], 2.0)]):
        want[rows] = x[rows] @ p.a.T @ p.b.T * s
    assert torch.allclose(y, want)


def test_the_stacked_product_equals_the_segmented_one() -> None:
    """Decode steps take ``add_lora_stacked``: for every row, its own adapter's update only."""
    slots, lens = [2, -1, 0, 2, 1, 0], [1, 1, 1, 1, 1, 1]
    plan = plan_segments(slots, lens, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64, generator=g)

    def pair(rank: int) -> LoraPair:
        a = torch.randn(rank, 8, dtype=torch.float64, generator=g)
        return LoraPair(a, torch.randn(5, rank, dtype=torch.float64, generator=g))

    pairs = {0: (pair(2), 0.5), 1: (pair(4), 2.0), 2: (pair(3), 1.5)}
    segmented, stacked_y = (
        torch.ones(6, 5, dtype=torch.float64),
        torch.ones(6, 5, dtype=torch.float64),
    )
    add_lora(x, segmented, plan, [pairs[s] for s in plan.slots])
    stacked = stack_pairs([(s, *pairs[s]) for s in plan.slots])
    add_lora_stacked(x, stacked_y, stacked, row_weights(plan, stacked))
    assert torch.allclose(segmented, stacked_y)
    assert torch.equal(stacked_y[1], torch.ones(5, dtype=torch.float64))  # the base row


def test_make_tiny_lora_writes_a_peft_adapter_with_nonzero_b(tiny_models, tmp_path: Path) -> None:
    from tandem.server.cli import main
    from tandem.server.engine.loader import read_model_config
    from tandem.server.engine.lora.adapter import load_adapter

    model = tiny_models["qwen3"]
    out = tmp_path / "adapter"
    args = ["make-tiny-lora", str(model), str(out), "--rank", "4", "--targets", "q_proj,down_proj"]
    assert main(args) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj"]
    adapter = load_adapter("a", out, read_model_config(model), max_rank=64)
    assert sorted({k[1] for k in adapter.pairs}) == ["down_proj", "qkv_proj"]
    assert all(p.b.abs().sum() > 0 for p in adapter.pairs.values())
