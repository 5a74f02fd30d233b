"""Speculation's cost model on measured step times: the curve (seconds by rows) read in one-row
steps, the plan it gives, and when a request's first proposed row must pay for itself. Pure
functions on injected times: no wall clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.server.engine import LLM, SamplingParams
from tandem.server.engine.spec_decode.cost import QUANTIZED_ROW_COST, StepCost
from tandem.server.engine.spec_decode.draft import ESTABLISHED, PROBE_EVERY, Draft
from tandem.server.engine.step_curve import ALPHA, StepCurve, curve_cost


def seed(rows: int) -> float:
    return 1 + 0.25 * (rows - 1)


def curve(seconds: dict[int, float]) -> StepCurve:
    c = StepCurve()
    for rows, s in seconds.items():
        c.record(rows, s)
    return c


def test_the_seed_stands_until_two_row_counts_are_measured() -> None:
    assert curve_cost({}, 5, seed) == 2.0
    assert curve_cost({5: 0.020}, 5, seed) == 2.0  # one point says nothing of a row's price
    # Two points: linear through them, in one-row steps, extended past the last.
    assert curve_cost({1: 0.010, 5: 0.014}, 3, seed) == pytest.approx(1.2)
    assert curve_cost({1: 0.010, 5: 0.014}, 7, seed) == pytest.approx(1.6)
    # Below the first measured count the seed gives the shape.
    assert curve_cost({2: 0.010, 4: 0.012}, 1, seed) == 1.0
    assert curve_cost({2: 0.010, 4: 0.012}, 3, seed) == pytest.approx(1.1 * 1.25)


def test_noise_is_cut_away_and_a_row_is_never_negative_work() -> None:
    """Noise on a shared machine only adds time: the curve is the lower convex hull of the
    averages, so a point measured dear is cut, each further row costs at least what the one
    before did, and nothing falls."""
    noisy = {1: 0.010, 2: 0.013, 3: 0.012, 4: 0.016}
    costs = [curve_cost(noisy, n, seed) for n in range(1, 7)]
    assert costs == sorted(costs)
    assert costs[1] == pytest.approx(1.1) and costs[2] == pytest.approx(1.2)  # 2's spike cut
    increments = [b - a for a, b in zip(costs, costs[1:])]
    # convex: adding rows greedily, the first that does not pay ends it rightly
    assert all(b >= a - 1e-12 for a, b in zip(increments, increments[1:]))
    dear = {1: 0.010, 2: 0.011, 3: 0.020, 4: 0.013}
    assert curve_cost(dear, 3, seed) == pytest.approx(1.2)
    assert curve_cost({1: 0.010, 2: 0.009, 3: 0.008}, 3, seed) == 1.0  # falling: flat
    # flat, then rising: weights read once for a few rows, compute past that
    flat = {1: 0.010, 2: 0.010, 4: 0.0101, 8: 0.014, 16: 0.022}
    assert curve_cost(flat, 4, seed) == pytest.approx(1.01)
    assert curve_cost(flat, 16, seed) == pytest.approx(2.2)


def test_the_curve_is_a_moving_average_per_row_count() -> None:
    c = curve({1: 0.010})
    c.record(1, 0.020)
    assert c.measured() == {1: pytest.approx(0.010 + ALPHA * 0.010)}
    # Row counts past ``upto`` (another code path) are left out of the cost.
    c = curve({1: 0.010, 2: 0.011, 9: 0.100})
    assert c.cost(8, seed, upto=8) == pytest.approx(1.7)
    assert c.cost(2, seed, upto=8) == pytest.approx(1.1)
    assert c.cost(2, seed) == pytest.approx(1.1)


def test_a_measured_curve_moves_the_plan() -> None:
    seeded = StepCost(QUANTIZED_ROW_COST, max_rows=8)
    assert seeded.plan(1, [4], [0.8]) == [3]
    # Rows measured cheap (a tenth of a step each): the 4th token pays its row.
    cheap = StepCost(QUANTIZED_ROW_COST, 8, curve=curve({1: 0.010, 5: 0.014}))
    assert cheap.plan(1, [4], [0.8]) == [4]
    assert cheap.step(3) == pytest.approx(1.2)
    # Rows measured dear (half a step each): fewer tokens pay, none at a low acceptance.
    dear = StepCost(QUANTIZED_ROW_COST, 8, curve=curve({1: 0.010, 5: 0.030}))
    assert dear.plan(1, [4], [0.8], free=[False]) == [2]
    assert dear.plan(1, [4], [0.3], free=[False]) == [0]
    assert dear.plan(1, [4], [0.99], free=[False]) == [4]


def test_a_first_row_pays_once_the_estimate_is_established() -> None:
    cost = StepCost(QUANTIZED_ROW_COST, max_rows=8)
    assert cost.plan(1, [4], [0.15]) == [1]  # free: a probe
    assert cost.plan(1, [4], [0.15], free=[False]) == [0]  # misses are not paid for
    assert cost.plan(1, [4], [0.8], free=[False]) == [3]  # hits pay as before
    # The room goes to the requests whose rows pay, best first.
    assert cost.plan(5, [4, 4, 4], [0.1, 0.9, 0.5], free=[False] * 3) == [0, 3, 0]
    assert cost.plan(5, [4, 4, 4], [0.1, 0.9, 0.5], free=[True, False, False]) == [1, 2, 0]


def test_a_draft_probes_until_established_and_after_idle_steps() -> None:
    d = Draft()
    for _ in range(ESTABLISHED):
        assert d.free
        assert d.next_length(4)
        d.record(4, 1, 4)
    assert not d.free
    while not d.free:  # the backoff's skips and steps without a proposal both count
        d.next_length(4)
    assert d.idle == PROBE_EVERY
    d.record(1, 1, 4)
    assert not d.free and d.idle == 0


def test_the_worker_times_verification_steps_into_the_curve(tiny_models: dict[str, Path]) -> None:
    """The engine's cost model reads the worker's curve, which the verification steps (rows
    of one request, all sampled) feed alongside plain decodes."""
    llm = LLM(str(tiny_models["llama"]), kv_cache_tokens=2048, speculative_method="ngram")
    assert llm.engine.speculator.cost.curve is llm.engine.worker.step_curve
    llm.engine.speculator.proposer = lambda ids, k: ([ids[-1]] * k, 2)  # always a guess
    prompt = list(range(5, 21))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate([prompt], params)
    assert llm.engine.stats().spec_num_drafts > 0
    assert any(rows > 1 for rows in llm.engine.worker.step_curve.measured())
