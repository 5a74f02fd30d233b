"""A random workload with aborts, n > 1, sessions and stop strings leaks no block and frees none twice."""

from __future__ import annotations

import random
from pathlib import Path

from tandem.server.engine import LLMEngine, SamplingParams
from tandem.server.engine.config import EngineConfig
from tandem.server.engine.sampler import sample


def test_random_workload_with_aborts_returns_every_block(llama_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(llama_dir),
            kv_cache_tokens=256,
            block_size=8,
            max_num_seqs=12,
            max_num_batched_tokens=48,
        )
    )
    rng = random.Random(7)
    vocab = engine.model_config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    live: list[str] = []
    finished = aborted = 0
    for step in range(400):
        if step < 300 and rng.random() < 0.6:
            rid = f"r{step}"
            prefix = shared[: rng.randrange(0, 40)]
            prompt = prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))]
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                max_tokens=rng.randrange(1, 40),
                n=rng.choice([1, 1, 2, 3]),
                seed=rng.randrange(100),
                stop=["ab"],
            )
            engine.add_request(rid, prompt, params, stream=rng.random() < 0.5)
            live.append(rid)
        if live and rng.random() < 0.15:
            victim = live.pop(rng.randrange(len(live)))
            aborted += engine.abort_request(victim)
        for out in engine.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
    assert finished > 20 and aborted > 5
    assert engine.stats().num_preemptions > 0  # the pool was tight enough to matter
    engine.kv.pool.check_all_free()  # raises on a leak; a double free would have raised in free()


def test_n_siblings_share_the_prompt_blocks(llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), kv_cache_tokens=4096, block_size=4))
    prompt = list(range(5, 45))  # 40 tokens: 9 full blocks shared after the fork
    engine.add_request(
        "g", prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    )
    shared_refs = []
    outs = []
    while engine.has_unfinished_requests():
        outs = engine.step() or outs
        group = [r for r in engine.scheduler.running]
        if len(group) == 3:
            shared_refs.append(engine.kv.pool.ref_count(group[0].block_ids[0]))
    assert max(shared_refs) == 3
    texts = {tuple(o.token_ids) for o in outs[0].outputs}
    assert len(outs[0].outputs) == 3 and len(texts) > 1
    engine.kv.pool.check_all_free()


def test_sampling_with_a_seed_does_not_depend_on_batch_mates(llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), kv_cache_tokens=4096))
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True
    )

    def run(extra: int) -> list[int]:
        engine.add_request("target", "The cache", params)
        for i in range(extra):
            engine.add_request(
                f"mate{extra}-{i}",
                f"noise {i} " * (i + 1),
                SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True),
            )
        result = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "target" and out.finished:
                    result = out.token_ids
        return result

    alone, crowded = run(0), run(5)
    assert alone == crowded
    engine.add_request("other-seed", "The cache", params.clone(seed=99))
    other = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            other = out.token_ids if out.finished else other
    assert other != alone


def test_sampler_filters_keep_draws_inside_the_allowed_set(llama_dir: Path) -> None:
    import torch

    from .utils import make_request

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 1)
    cases = [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.75), {0, 1}),
        (dict(min_p=0.3), {0, 1}),
        (dict(top_k=1), {0}),
    ]
    for kwargs, allowed in cases:
        seen = set()
        for seed in range(200):
            req = make_request([1], "s")
            req.params = SamplingParams(temperature=1.0, **kwargs)
            req.sampling.generator = torch.Generator().manual_seed(seed)
            seen.add(sample(logits.clone(), [req]).token_ids[0])
        assert seen == allowed, (kwargs, seen)


def test_draws_follow_the_softmax_and_never_pick_a_masked_token() -> None:
    """Inverse-CDF sampling: 20,000 draws of one request land on each token as often as its
    probability says (within 4 standard deviations), and a token masked out (first and last
    positions, where an off-by-one in the table would show) is never drawn."""
    import torch

    from .utils import make_request

    probs = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.0])
    logits = probs.log().unsqueeze(0)  # -inf where masked
    req = make_request([1], "d")
    req.params = SamplingParams(temperature=1.0)
    req.sampling.generator = torch.Generator().manual_seed(7)
    draws = torch.tensor([sample(logits.clone(), [req]).token_ids[0] for _ in range(20000)])
    freq = torch.bincount(draws, minlength=6).double() / 20000
    assert freq[0] == 0 and freq[5] == 0
    sd = (probs * (1 - probs) / 20000).sqrt().double()
    assert ((freq - probs.double()).abs() <= 4 * sd + 1e-12).all(), freq


def test_penalties_and_logit_bias_change_the_processed_logits() -> None:
    import torch

    from .utils import make_request

    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    req = make_request([3], "p")
    req.output_token_ids = [0, 0]
    req.params = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    assert sample(logits, [req]).token_ids == [1]  # 2.0 - 2*0.1 < 1.9
    req.params = SamplingParams(temperature=0.0, presence_penalty=0.2)
    assert sample(logits, [req]).token_ids == [1]
    req.params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert sample(logits, [req]).token_ids == [1]  # 2.0 / 1.2 < 1.9
    req.params = SamplingParams(temperature=0.0, logit_bias={2: 10.0})
    assert sample(logits, [req]).token_ids == [2]
    req.output_token_ids = []
    req.sampling.eos_token_ids = frozenset({0})
    req.params = SamplingParams(temperature=0.0, min_tokens=1)
    assert sample(logits, [req]).token_ids == [1]  # EOS masked until min_tokens


def test_repetition_penalty_matches_transformers(llama_dir: Path) -> None:
    from tandem.server.engine import LLM

    from ..hf_reference import hf_greedy

    llm = LLM(str(llama_dir), kv_cache_tokens=4096)
    ids = llm.tokenizer.encode("The cat sat on the mat. The dog chased the ball.")
    out = llm.generate(
        [ids],
        SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=24, ignore_eos=True),
    )[0]
    assert out.token_ids == hf_greedy(llama_dir, ids, 24, repetition_penalty=1.5)[0]
