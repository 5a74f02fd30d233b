"""The sampler never hands back a token outside the vocabulary (issue 26, item 1).

A token id ``>= vocab`` sampled for one request used to fail the next step's embedding
lookup for every request in the batch. Whatever the parameters ``SamplingParams`` accepts
and whatever the logits hold, each row gets a token inside the vocabulary or an error of
its own, and the other rows sample exactly what they sample alone.
"""

from __future__ import annotations

import pytest
import torch

from tandem.server.engine import SamplingParams
from tandem.server.engine.request import Request, SamplingState
from tandem.server.engine.sampler import LOGITS_NOT_FINITE, NO_TOKEN_ALLOWED, sample

VOCAB = 97
EOS = 3


def _request(params: SamplingParams, seed: int = 0, outputs: list[int] | None = None) -> Request:
    return Request(
        request_id=f"r{seed}",
        prompt_token_ids=[5, 6, 7, 8],
        params=params,
        sampling=SamplingState(
            max_tokens=params.max_tokens or 16,
            eos_token_ids=frozenset({EOS}),
            generator=torch.Generator().manual_seed(seed),
        ),
        arrival_order=seed,
        group_id=f"r{seed}",
        output_token_ids=list(outputs or []),
    )


def _logits(rows: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 8


# Every value here is one SamplingParams accepts; the extremes of each field, and together.
HOSTILE = {
    "temperature 1e-300": dict(temperature=1e-300),
    "temperature just under the greedy floor": dict(temperature=9.9e-6),
    "temperature at the floor": dict(temperature=1e-5),
    "temperature 1e300": dict(temperature=1e300),
    "repetition_penalty 1e-300": dict(repetition_penalty=1e-300),
    "repetition_penalty 1e300": dict(repetition_penalty=1e300),
    "repetition_penalty 1e-300, temperature 1e-5": dict(
        repetition_penalty=1e-300, temperature=1e-5
    ),
    "repetition_penalty 1e300, temperature 1e300": dict(
        repetition_penalty=1e300, temperature=1e300
    ),
    "penalties at their bounds": dict(presence_penalty=-2.0, frequency_penalty=2.0, min_p=1.0),
    "top_p at its smallest": dict(top_p=1e-300, top_k=2**62),
    "logit_bias everywhere": dict(logit_bias={t: 100.0 for t in range(VOCAB)}, temperature=1e-5),
    "logit_bias down everywhere": dict(logit_bias={t: -100.0 for t in range(VOCAB)}),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_parameters_always_give_a_token_inside_the_vocabulary(name: str) -> None:
    params = SamplingParams(max_tokens=8, logprobs=2, **HOSTILE[name])
    for seed in range(8):
        req = _request(params, seed, outputs=[9, 9, 10])  # seen tokens: penalties apply
        logits = _logits(1, seed)
        logits[0, ::5] = float("-inf")  # a grammar's mask
        out = sample(logits, [req])
        assert out.errors == [None], name
        assert 0 <= out.token_ids[0] < VOCAB and out.token_ids[0] % 5 != 0, name
        assert out.logprobs[0] is not None and out.logprobs[0].token_id == out.token_ids[0]


def test_a_temperature_below_the_floor_is_greedy_and_draws_nothing() -> None:
    req = _request(SamplingParams(temperature=1e-300))
    before = req.sampling.generator.get_state()
    logits = _logits(1)
    assert sample(logits.clone(), [req]).token_ids == [int(logits[0].argmax())]
    assert torch.equal(req.sampling.generator.get_state(), before)


BAD_ROWS = {
    "a NaN": (lambda row: row.__setitem__(7, float("nan")), LOGITS_NOT_FINITE),
    "all NaN": (lambda row: row.fill_(float("nan")), LOGITS_NOT_FINITE),
    "an infinity": (lambda row: row.__setitem__(7, float("inf")), LOGITS_NOT_FINITE),
    "every token masked": (lambda row: row.fill_(float("-inf")), NO_TOKEN_ALLOWED),
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("bad", BAD_ROWS)
def test_a_bad_row_fails_alone_and_the_others_sample_what_they_sample_alone(
    bad: str, greedy: bool
) -> None:
    spoil, code = BAD_ROWS[bad]
    params = SamplingParams(temperature=0.0 if greedy else 0.8, top_p=0.9, logprobs=1)
    logits = _logits(4)
    alone = [sample(logits[i : i + 1].clone(), [_request(params, i)]) for i in range(4)]
    spoiled = logits.clone()
    spoil(spoiled[2])
    out = sample(spoiled, [_request(params, i) for i in range(4)])
    assert out.token_ids[2] is None and out.logprobs[2] is None
    assert out.errors[2] is not None and out.errors[2].code == code and out.errors[2].message
    for i in (0, 1, 3):
        assert out.errors[i] is None
        assert out.token_ids[i] == alone[i].token_ids[0]
        assert out.logprobs[i] == alone[i].logprobs[0]


def test_a_row_that_overflows_at_its_temperature_fails_alone() -> None:
    """A finite logit of 1e36 divided by a temperature of 1e-4 is inf in float32."""
    logits = _logits(2)
    logits[1, 4] = 1e36
    reqs = [_request(SamplingParams(temperature=0.0)), _request(SamplingParams(temperature=1e-4))]
    out = sample(logits, reqs)
    assert out.token_ids[0] == int(logits[0].argmax()) and out.errors[0] is None
    assert out.token_ids[1] is None and out.errors[1].code == LOGITS_NOT_FINITE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_read_their_argmax_in_the_models_dtype(dtype: torch.dtype) -> None:
    """A batch of greedy rows that ask for nothing else takes each row's first largest logit
    straight from the logits as the model made them (no float32 copy): the token torch's
    argmax of the float32 logits gives, ties included, and a NaN row fails alone."""
    logits = (_logits(6) / 4).round().to(dtype)  # integers: several maxima in a row
    logits[4, 11] = float("nan")
    reqs = [_request(SamplingParams(temperature=0.0), seed=i) for i in range(6)]
    out = sample(logits, reqs)
    want = logits.float().argmax(dim=-1).tolist()
    for i in (0, 1, 2, 3, 5):
        assert out.token_ids[i] == want[i] and out.errors[i] is None
    assert out.token_ids[4] is None and out.errors[4].code == LOGITS_NOT_FINITE
    assert out.logprobs == [None] * 6


MIXED = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.9, top_k=20, top_p=0.5, min_p=0.01),
    dict(temperature=1.0, presence_penalty=1.5, top_p=0.95),
]


def test_rows_drawn_together_draw_what_each_draws_alone() -> None:
    """The batch's draws run as one op per stage over all rows (sampler._draw); a row's
    token still depends on its own logits, parameters and generator alone."""
    logits = _logits(len(MIXED), seed=5)
    for seed in range(6):
        reqs = [_request(SamplingParams(**p), seed * 10 + i, [9, 9]) for i, p in enumerate(MIXED)]
        together = sample(logits.clone(), reqs).token_ids
        alone = [
            sample(
                logits[i : i + 1].clone(), [_request(SamplingParams(**p), seed * 10 + i, [9, 9])]
            )
            for i, p in enumerate(MIXED)
        ]
        assert together == [a.token_ids[0] for a in alone]


def test_top_p_keeps_the_fewest_likeliest_tokens_whose_predecessors_stay_within_it() -> None:
    """Probabilities 0.4, 0.25 (ids 3 and 11), 0.1 (rest ~0) with top_p 0.5: the first is kept
    (nothing before it) and one of the 0.25s (0.4 before it), the lower id; the other 0.25
    (0.65 before it) and the 0.1 never come."""
    probs = torch.full((VOCAB,), 1e-12)
    probs[[7, 11, 3, 5]] = torch.tensor([0.4, 0.25, 0.25, 0.1])
    logits = probs.log().unsqueeze(0)
    drawn = {
        sample(logits.clone(), [_request(SamplingParams(top_p=0.5), seed)]).token_ids[0]
        for seed in range(200)
    }
    assert drawn == {7, 3}


def test_top_p_over_equal_probabilities_keeps_as_many_as_it_allows() -> None:
    """Four equally likely tokens and top_p 0.5: three are kept (0, 0.25 and 0.5 before
    them), the three lowest ids."""
    logits = torch.full((1, VOCAB), -1e4)
    logits[0, [40, 2, 90, 17]] = 0.0
    drawn = {
        sample(logits.clone(), [_request(SamplingParams(top_p=0.5), seed)]).token_ids[0]
        for seed in range(200)
    }
    assert drawn == {2, 17, 40}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_at_a_temperature_alone_draw_the_same_on_either_path(dtype: torch.dtype) -> None:
    """A batch of rows that only their temperatures shape is drawn from the logits as the
    model made them (``kernels.draw_rows``, where it runs); the same rows in a batch that
    needs float32 (beside a penalised greedy row) draw the same tokens, and a NaN row fails
    alone either way."""
    logits = _logits(5, seed=2).to(dtype)
    logits[3, 7] = float("nan")
    temps = [1.0, 0.7, 1e300, 1.0, 1e-5]

    def rows(seed: int) -> list[Request]:
        return [_request(SamplingParams(temperature=t), seed * 10 + i) for i, t in enumerate(temps)]

    for seed in range(6):
        alone = sample(logits.clone(), rows(seed))
        penalised = _request(SamplingParams(temperature=0.0, presence_penalty=1.0), 99, [4])
        mixed = sample(torch.cat([logits, logits[:1]]), rows(seed) + [penalised])
        assert mixed.token_ids[:5] == alone.token_ids and mixed.token_ids[5] is not None
        assert alone.token_ids[3] is None and alone.errors[3].code == LOGITS_NOT_FINITE
        assert all(0 <= t < VOCAB for i, t in enumerate(alone.token_ids) if i != 3)
