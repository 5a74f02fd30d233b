"""CUDA graphs for decode: which size a batch replays, how it is padded, and tokens with and without.

The bucket choice and the padding are pure and run on CPU (the padded batch goes through the
real model with the torch backend: the real rows must not change, and the padding may
write only into the null page). Capture and replay need a GPU (marked ``cuda``).
"""

from __future__ import annotations

import pytest
import torch

from tandem.server.engine.config import EngineConfig
from tandem.server.engine.loader import read_model_config
from tandem.server.engine.model_runner import (
    ModelRunner,
    StepInputs,
    graph_batch_sizes,
    pad_decode_inputs,
    pick_graph_size,
)

HAS_CUDA = torch.cuda.is_available()


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]
    assert graph_batch_sizes(4096)[-1] == 512


def test_pick_graph_size() -> None:
    sizes = graph_batch_sizes(64)
    assert [pick_graph_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        32,
        64,
    ]
    assert pick_graph_size(65, sizes) is None
    assert pick_graph_size(0, sizes) is None


def test_pad_decode_inputs_points_padding_at_the_null_page() -> None:
    inputs = StepInputs(
        [11, 12, 13], [5, 20, 7], [37, 90, 55], [1, 1, 1], [6, 21, 8], [[2], [3, 5], [3]], [0, 1, 2]
    )
    p = pad_decode_inputs(inputs, 8)
    assert p.num_seqs == 8 and p.input_ids[:3] == [11, 12, 13] and p.slots[:3] == [37, 90, 55]
    assert p.slots[3:] == [0] * 5  # slot 0 lies in block 0
    assert (
        p.block_tables[3:] == [[0]] * 5 and p.kv_lens[3:] == [1] * 5 and p.positions[3:] == [0] * 5
    )
    assert p.logits_rows == [0, 1, 2]
    with pytest.raises(ValueError):
        pad_decode_inputs(inputs, 2)
    with pytest.raises(ValueError, match="decode"):
        pad_decode_inputs(StepInputs([1, 2], [0, 1], [16, 17], [2], [2], [[1]], [1]), 4)


def test_padded_decode_changes_no_real_row_and_no_real_slot(llama_dir) -> None:
    bs = 4
    config = EngineConfig(
        str(llama_dir), dtype="float32", device="cpu", block_size=bs, kv_cache_tokens=15 * bs
    )
    runner = ModelRunner(config, read_model_config(llama_dir), torch.device("cpu"))
    cache = runner.kv_cache
    assert cache.num_blocks == 16 and runner.backend.name == "torch"
    # prefill three sequences: 5, 9 and 2 tokens in blocks [1, 2], [3, 4, 5], [6]
    tables = [[1, 2], [3, 4, 5], [6]]
    lens = [5, 9, 2]
    ids, pos, slots = [], [], []
    for t, n in zip(tables, lens):
        ids += list(range(100, 100 + n))
        pos += list(range(n))
        slots += [t[p // bs] * bs + p % bs for p in range(n)]
    rows = [4, 13, 15]
    runner.run(StepInputs(ids, pos, slots, lens, lens, tables, rows))
    decode = StepInputs(
        [7, 8, 9],
        lens,
        [t[n // bs] * bs + n % bs for t, n in zip(tables, lens)],
        [1, 1, 1],
        [n + 1 for n in lens],
        tables,
        [0, 1, 2],
    )
    before = cache.data.clone()
    want = runner.run(decode)
    after_eager = cache.data.clone()
    cache.data.copy_(before)
    got = runner.run(pad_decode_inputs(decode, 8))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.data[:, :, 1:], after_eager[:, :, 1:], rtol=1e-5, atol=1e-5)
    flat_changed = (
        (cache.data != before).flatten(0, 1).flatten(1, 2).any(-1).any(-1).any(0)
    )  # per slot
    changed = set(flat_changed.nonzero().flatten().tolist())
    assert changed - set(range(bs)) == set(
        decode.slots
    )  # outside the null page: only the real slots


# ----- GPU ---------------------------------------------------------------------------------------
def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


needs_gpu = pytest.mark.skipif(
    not (HAS_CUDA and _has_flashinfer()), reason="needs CUDA and flashinfer"
)


def _tokens(model_dir, **kw):
    from tandem.server.engine import LLM, SamplingParams

    # 19 sequences: decode batches of 19, then fewer as they finish (padded to 32, 16, 8, ...)
    prompts = [[3 + i, 50 + 7 * i, 9, 200 + i] * (1 + i % 5) for i in range(19)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(19)
    ]
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="bfloat16",
        kv_cache_tokens=16384,
        max_num_seqs=32,
        **kw,
    )
    return llm, [o.token_ids for o in llm.generate(prompts, params)]


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graphs_on_and_off_give_the_same_tokens(gpu_models, arch: str) -> None:
    graphs, with_graphs = _tokens(gpu_models[arch], attention_backend="flashinfer")
    assert graphs.engine.worker.runner.graph_sizes == [1, 2, 4, 8, 16, 32]
    _, eager = _tokens(gpu_models[arch], attention_backend="flashinfer", enforce_eager=True)
    assert with_graphs == eager


@needs_gpu
@pytest.mark.cuda
def test_graphs_survive_sleep_and_wake(gpu_models) -> None:
    llm, first = _tokens(gpu_models["llama"], attention_backend="flashinfer")
    llm.engine.sleep(1)
    llm.engine.wake_up()
    assert llm.engine.worker.runner.graph_sizes
    from tandem.server.engine import SamplingParams

    prompts = [[3 + i, 50 + 7 * i, 9, 200 + i] * (1 + i % 5) for i in range(19)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(19)
    ]
    assert [o.token_ids for o in llm.generate(prompts, params)] == first
