"""The CPU worker's start-up step (``ModelRunner.warm_up``): a full prefill step's worth of
tokens through the real model whose K/V land in the null page only, so what any sequence
computes afterwards is what it computes without it."""

from __future__ import annotations

import torch

from tandem.server.engine.config import EngineConfig
from tandem.server.engine.loader import read_model_config
from tandem.server.engine.model_runner import ModelRunner, StepInputs

BS = 4


def test_warm_up_writes_only_the_null_page_and_changes_no_logits(llama_dir) -> None:
    config = EngineConfig(
        str(llama_dir), dtype="float32", device="cpu", block_size=BS, kv_cache_tokens=15 * BS
    )
    runner = ModelRunner(config, read_model_config(llama_dir), torch.device("cpu"))
    cache = runner.kv_cache
    prompt = StepInputs(
        list(range(100, 106)), list(range(6)), list(range(4, 10)), [6], [6], [[1, 2]], [5]
    )
    decode = StepInputs([7], [6], [10], [1], [7], [[1, 2]], [0])
    runner.run(prompt)
    before = cache.data.clone()
    want = runner.run(decode)
    cache.data.copy_(before)

    runner.warm_up(150)  # more tokens than a sequence may hold (60): several sequences

    changed = (cache.data != before).flatten(3).any(-1).any(1).any(0)  # per block
    assert changed.nonzero().flatten().tolist() == [0]
    torch.testing.assert_close(runner.run(decode), want, rtol=0, atol=0)
