"""The last layer finishes only the rows a step reads (``KeptRows``): a prompt's other rows,
and every row of a chunk that does not end its prompt, stop at their K and V there."""

from __future__ import annotations

import pytest
import torch

from tandem.server.engine.config import EngineConfig
from tandem.server.engine.loader import read_model_config
from tandem.server.engine.model_runner import ModelRunner, StepInputs, last_layer_tails

BS = 4


def test_tails_run_from_each_sequences_first_read_row_to_its_end() -> None:
    lens = [1, 2, 13, 8]  # a decode, a prefix hit's last rows, a chunk, a speculating request
    assert last_layer_tails(lens, [0, 2, 21, 22, 23]) == [1, 1, 0, 3]
    assert last_layer_tails(lens, [0, 2, 21, 22, 23, *range(3, 16)]) == [1, 1, 13, 3]
    assert last_layer_tails(lens, []) == [0, 0, 0, 0]


def step(logits_rows: list[int]) -> StepInputs:
    """A prompt of 6 tokens (blocks 1-2) and the first 5 of another (blocks 3-4)."""
    return StepInputs(
        input_ids=[*range(100, 106), *range(200, 205)],
        positions=[*range(6), *range(5)],
        slots=[*range(4, 10), *range(12, 17)],
        query_lens=[6, 5],
        kv_lens=[6, 5],
        block_tables=[[1, 2], [3, 4]],
        logits_rows=logits_rows,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rows_read_and_every_k_and_v_are_those_of_the_whole_step(llama_dir, dtype) -> None:
    config = EngineConfig(
        str(llama_dir), dtype=dtype, device="cpu", block_size=BS, kv_cache_tokens=15 * BS
    )
    runner = ModelRunner(config, read_model_config(llama_dir), torch.device("cpu"))
    every = runner.run(step(list(range(11))))  # every row read: no row left out
    whole = runner.kv_cache.data.clone()
    runner.kv_cache.data.zero_()

    last = runner.run(step([5]))  # only the first prompt's last row: 1 of 11 finished

    torch.testing.assert_close(last, every[5:6])
    torch.testing.assert_close(runner.kv_cache.data, whole, rtol=0, atol=0)
    runner.kv_cache.data.zero_()
    assert runner.run(step([])).shape == (0, 0)  # no row read: K and V alone
    torch.testing.assert_close(runner.kv_cache.data, whole, rtol=0, atol=0)
