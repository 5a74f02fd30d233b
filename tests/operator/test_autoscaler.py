"""The SLO planner's arithmetic: load + profile + SLO -> replicas, and its stabilisation."""

from __future__ import annotations

import json
import math

import pytest

from tandem.operator.autoscaler.planner import PlannerConfig, PlannerState, step
from tandem.operator.autoscaler.profile import EngineProfile
from tandem.operator.autoscaler.sizing import (
    Correction,
    Headroom,
    Load,
    SloTarget,
    correction,
    decode_batch_limit,
    prefill_utilisation,
    recommend,
)
from tandem.operator.autoscaler.stabilization import Bounds, PoolState, Stabilization, stabilize

# A profile simple enough to do the arithmetic by hand:
# prefill runs 10,000 tokens/s at any length (1,000 tokens take 0.1 s);
# a decode step takes 10 ms + 0.1 ms per sequence, whatever the context.
PROFILE = EngineProfile(
    prefill_isl=(100, 10_000),
    prefill_tps=(10_000.0, 10_000.0),
    decode_batch=(1, 101),
    decode_ctx=(100, 10_000),
    decode_step_s=((0.0101, 0.0101), (0.0201, 0.0201)),
    kv_cache_tokens=1_000_000,
    max_num_seqs=512,
)
SLO = SloTarget(ttft_s=0.5, itl_s=0.02, attainment=0.99)


def test_profile_interpolates_and_round_trips() -> None:
    assert PROFILE.prefill_seconds(1000) == pytest.approx(0.1)
    assert PROFILE.step_seconds(51, 500) == pytest.approx(0.0151)
    assert EngineProfile.from_dict(PROFILE.to_dict()) == PROFILE
    falling = EngineProfile(**{**PROFILE.__dict__, "prefill_tps": (20_000.0, 10_000.0)})
    assert falling.prefill_seconds(40_000) == pytest.approx(4.0)  # held at 10,000 tokens/s


def test_prefill_utilisation_solves_the_kingman_tail() -> None:
    rho = prefill_utilisation(service_s=0.1, budget_s=0.5, miss=0.01, cs2=0.0)
    # P(W > 0.4 s) = rho * exp(-2 (1 - rho) * 0.4 / 0.1) equals the allowed miss rate
    assert rho * math.exp(-8 * (1 - rho)) == pytest.approx(0.01, rel=1e-6)
    assert 0.3 < rho < 0.6
    # variable prompt lengths make the tail heavier: less utilisation allowed
    assert prefill_utilisation(0.1, 0.5, 0.01, cs2=1.0) < rho
    # a looser target allows more
    assert prefill_utilisation(0.1, 1.0, 0.01, 0.0) > rho
    # a prompt that alone takes longer than the target cannot be served within it
    assert prefill_utilisation(0.6, 0.5, 0.01, 0.0) == 0.0


def test_decode_batch_limit_is_the_largest_batch_meeting_the_itl_target() -> None:
    # 10 ms + 0.1 ms * b <= 20 ms  ->  b <= 100
    assert decode_batch_limit(PROFILE, 0.02, 1000, 100, 1.0) == 100
    # engines measured 25% slower than the profile: 1.25 * (10.1 + 0.1 (b - 1)) ms <= 20 ms
    assert decode_batch_limit(PROFILE, 0.02, 1000, 100, 1.25) == 60
    # the KV cache holds only 20 sequences of 1,100 tokens
    small_kv = EngineProfile(**{**PROFILE.__dict__, "kv_cache_tokens": 22_000})
    assert decode_batch_limit(small_kv, 0.02, 1000, 100, 1.0) == 20


def test_recommend_sizes_each_pool_for_its_own_slo_term() -> None:
    load = Load(rate=20.0, isl=1000, osl=200)
    rec = recommend(load, PROFILE, SLO)
    rho = prefill_utilisation(0.1, 0.5, 0.01, 0.0)
    assert rec.prefill_rate_per_replica == pytest.approx(rho / 0.1)
    assert rec.prefill == math.ceil(20.0 / (rho / 0.1))
    # mean batch m with m + 2.326 sqrt(m) = 100
    m = rec.decode_batch
    assert m + 2.3263 * math.sqrt(m) == pytest.approx(100, abs=0.01)
    per_decode = m / (0.0101 + 0.0001 * (m - 1))
    assert rec.decode_tokens_per_replica == pytest.approx(per_decode)
    assert rec.decode == math.ceil(20.0 * 200 / per_decode)
    assert rec.feasible


def test_long_outputs_need_more_decode_and_long_prompts_more_prefill() -> None:
    base = recommend(Load(40.0, 1000, 200), PROFILE, SLO)
    longer_out = recommend(Load(40.0, 1000, 800), PROFILE, SLO)
    longer_in = recommend(Load(40.0, 3000, 200), PROFILE, SLO)
    assert longer_out.decode > base.decode and longer_out.prefill == base.prefill
    assert longer_in.prefill > base.prefill


def test_no_load_needs_no_replicas_and_any_load_at_least_one() -> None:
    assert (recommend(Load(0.0, 1000, 200), PROFILE, SLO).prefill, 0) == (0, 0)
    rec = recommend(Load(0.01, 1000, 200), PROFILE, SLO)
    assert (rec.prefill, rec.decode) == (1, 1)


def test_prefill_backlog_counts_as_rate_to_drain() -> None:
    calm = recommend(Load(10.0, 1000, 200), PROFILE, SLO)
    burst = recommend(
        Load(10.0, 1000, 200, prefill_backlog=600), PROFILE, SLO, headroom=Headroom(drain_s=60)
    )
    same_rate = recommend(Load(20.0, 1000, 200), PROFILE, SLO)
    assert burst.prefill == same_rate.prefill > calm.prefill
    assert burst.decode == calm.decode


def test_decode_backlog_counts_as_rate_to_drain() -> None:
    calm = recommend(Load(40.0, 1000, 200), PROFILE, SLO)
    backlog = recommend(
        Load(40.0, 1000, 200, decode_backlog=1200), PROFILE, SLO, headroom=Headroom(drain_s=60)
    )
    same_rate = recommend(Load(60.0, 1000, 200), PROFILE, SLO)
    assert backlog.decode == same_rate.decode > calm.decode
    assert backlog.prefill == calm.prefill


def _limits(load: Load) -> tuple[float, float]:
    """Requests/s one prefill replica takes, and tokens/s one decode replica makes, at the
    SLO limit: the median prompt's TTFT and the largest batch's step meet the targets."""
    service = load.isl / 10_000
    rho = prefill_utilisation(service, SLO.ttft_s, 0.5, load.isl_cv**2)
    b_star = decode_batch_limit(PROFILE, SLO.itl_s, load.isl, load.osl, 1.0)
    return rho / service, b_star / (0.0101 + 0.0001 * (b_star - 1))


def test_surge_sizes_the_running_pools_to_carry_a_step_at_the_slo_limit() -> None:
    load = Load(40.0, 1000, 200)
    plain = recommend(load, PROFILE, SLO)
    rec = recommend(load, PROFILE, SLO, headroom=Headroom(lead_s=60, surge=1.0))
    per_prefill, per_decode = _limits(load)
    # the limit is looser than the target: a surge costs a replica of each pool here, not 2x
    assert per_prefill > plain.prefill_rate_per_replica
    assert per_decode > plain.decode_tokens_per_replica
    assert rec.prefill == max(plain.prefill, math.ceil(80.0 / per_prefill))
    assert rec.decode == max(plain.decode, math.ceil(80.0 * 200 / per_decode))
    assert rec.decode > plain.decode
    # what the pools hold at the limit covers the doubled load
    assert rec.decode * per_decode >= 80.0 * 200 and rec.prefill * per_prefill >= 80.0
    # and no more than the doubled load needs at the target
    doubled = recommend(Load(80.0, 1000, 200), PROFILE, SLO)
    assert (rec.prefill, rec.decode) <= (doubled.prefill, doubled.decode)


def test_a_rising_trend_is_planned_for_one_start_up_ahead() -> None:
    ramp = Load(40.0, 1000, 200, rate_trend=0.5)  # +30 req/s within the 60 s lead
    rec = recommend(ramp, PROFILE, SLO, headroom=Headroom(lead_s=60, surge=0.1))
    per_prefill, per_decode = _limits(ramp)
    assert rec.decode == math.ceil(70.0 * 200 / per_decode)
    assert rec.prefill == max(recommend(ramp, PROFILE, SLO).prefill, math.ceil(70.0 / per_prefill))
    # a falling trend plans nothing ahead: the surge allowance alone
    falling = recommend(
        Load(40.0, 1000, 200, rate_trend=-0.5), PROFILE, SLO, Correction(), Headroom(60, 0.1)
    )
    assert falling.decode == max(
        recommend(Load(40.0, 1000, 200), PROFILE, SLO).decode, math.ceil(44.0 * 200 / per_decode)
    )


def test_step_plans_ahead_by_the_profiles_start_up() -> None:
    slow_start = EngineProfile(**{**PROFILE.__dict__, "startup_s": 285.0})
    b = Bounds(1, 100)
    cfg = PlannerConfig(SLO, slow_start, b, b, surge=0.0)
    assert cfg.headroom() == Headroom(lead_s=300.0, surge=0.0)
    ramp = Load(40.0, 1000, 200, rate_trend=0.1)  # +30 req/s within 300 s
    state, _ = step(PlannerState(PoolState(1), PoolState(1)), 0.0, ramp, cfg)
    ahead = recommend(Load(70.0, 1000, 200), PROFILE, SLO)
    per_decode = _limits(ramp)[1]
    assert state.decode.replicas == math.ceil(70.0 * 200 / per_decode) <= ahead.decode
    assert EngineProfile.from_dict(slow_start.to_dict()) == slow_start


def test_infeasible_slo_is_flagged() -> None:
    rec = recommend(Load(1.0, 8000, 10), PROFILE, SLO)  # 0.8 s of prefill > 0.5 s TTFT
    assert not rec.feasible


def test_correction_scales_the_profile_and_is_clamped() -> None:
    assert correction(0.03, 0.02) == pytest.approx(1.5)
    assert correction(1.0, 0.01) == 4.0
    assert correction(None, 0.02) == 1.0
    slow = recommend(Load(20.0, 1000, 200), PROFILE, SLO, Correction(prefill=1.5, decode=1.5))
    fast = recommend(Load(20.0, 1000, 200), PROFILE, SLO)
    assert slow.prefill > fast.prefill and slow.decode > fast.decode


def test_stabilize_scales_up_at_once_and_down_only_after_the_window() -> None:
    bounds, cfg = Bounds(1, 10), Stabilization(scale_down_window_s=300, down_margin=0.2)
    s = stabilize(PoolState(2), 0, at_load=5, at_margin=6, bounds=bounds, cfg=cfg)
    assert s.replicas == 5
    s = stabilize(s, 60, at_load=2, at_margin=3, bounds=bounds, cfg=cfg)
    assert s.replicas == 5  # the window still remembers 6
    s = stabilize(s, 310, at_load=2, at_margin=3, bounds=bounds, cfg=cfg)
    assert s.replicas == 3  # to the highest recommendation of the last 300 s
    # hysteresis: at_load fits in 3 but at_margin does not fit in fewer: stay
    s = stabilize(s, 700, at_load=2, at_margin=3, bounds=bounds, cfg=cfg)
    assert s.replicas == 3
    assert stabilize(s, 701, at_load=50, at_margin=60, bounds=bounds, cfg=cfg).replicas == 10


def test_a_fresh_state_keeps_its_size_for_one_window() -> None:
    s = stabilize(PoolState(6), 0, at_load=1, at_margin=1, bounds=Bounds(1, 10))
    assert s.replicas == 6  # e.g. the operator restarted: no blind scale-down
    s = stabilize(s, 301, at_load=1, at_margin=1, bounds=Bounds(1, 10))
    assert s.replicas == 1


def test_stabilize_respects_min_replicas_zero() -> None:
    s = stabilize(PoolState(1, ((-300, 1),)), 0, at_load=0, at_margin=0, bounds=Bounds(0, 4))
    assert s.replicas == 0
    assert stabilize(s, 1, at_load=1, at_margin=1, bounds=Bounds(0, 4)).replicas == 1


def test_step_plans_both_pools() -> None:
    b = Bounds(1, 50)
    cfg = PlannerConfig(SLO, PROFILE, b, b)
    state, rec = step(PlannerState(PoolState(1), PoolState(1)), 0.0, Load(20.0, 1000, 200), cfg)
    assert (state.prefill.replicas, state.decode.replicas) == (rec.prefill, rec.decode)


def test_load_from_metrics_and_one_planning_round() -> None:
    from tandem.operator.autoscaler.metrics import load_from_samples
    from tandem.operator.autoscaler.planner import decide

    samples = {
        "rate": 20.0,
        "prompt_tokens": 20_000.0,
        "output_tokens": 4_000.0,
        "finished": 20.0,
        "backlog": 0.0,
        "ttft": None,
        "itl": None,
    }
    load = load_from_samples(samples)
    assert (load.rate, load.isl, load.osl) == (20.0, 1000.0, 200.0)
    assert load_from_samples({**samples, "trend": 0.2, "decode_backlog": 7.0}) == Load(
        20.0, 1000.0, 200.0, rate_trend=0.2, decode_backlog=7.0
    )
    b = Bounds(1, 50)
    cfg = PlannerConfig(SLO, PROFILE, b, b)
    d = decide(None, 0.0, samples, cfg, current=(1, 1))
    rec = recommend(load, PROFILE, SLO, headroom=cfg.headroom())
    assert (d.prefill, d.decode) == (rec.prefill, rec.decode)
    # engines measured twice as slow as the profile on decode: more decode replicas
    slow = decide(None, 0.0, {**samples, "itl": 1.0}, cfg, current=(1, 1))
    assert slow.decode > d.decode and slow.prefill == d.prefill
    # no traffic and no series (a pool at zero): the minimum
    idle = decide(None, 0.0, {}, PlannerConfig(SLO, PROFILE, Bounds(0, 5), Bounds(0, 5)), (0, 0))
    assert (idle.prefill, idle.decode) == (0, 0)


def test_planner_queries_name_metrics_the_engine_and_proxy_export() -> None:
    import re

    from tandem.operator.autoscaler.metrics import queries
    from tandem.server.api.engine_loop import AsyncEngine
    from tandem.server.api.metrics import ServerMetrics
    from tandem.server.proxy.app import build_app
    from tandem.server.proxy.metrics import ProxyCollector
    from tandem.server.proxy.state import ProxySettings

    loop = AsyncEngine(lambda: None)  # never started: its counters are the collector's input
    engine = ServerMetrics("m", lambda: loop)
    engine.ttft.observe(0.1)
    engine.itl.observe(0.01)
    from prometheus_client import CollectorRegistry, generate_latest

    proxy_reg = CollectorRegistry()
    proxy_state = build_app(ProxySettings()).state.proxy
    proxy_state.flow.stats.count("/v1/completions", "disaggregated", 200)
    proxy_reg.register(ProxyCollector(proxy_state))
    exported = engine.render().decode() + generate_latest(proxy_reg).decode()
    declared = {line.split(" ")[2] for line in exported.splitlines() if line.startswith("# TYPE")}
    for query in queries("ns", "svc").values():
        for metric in re.findall(r"([a-z_:]+)\{", query):
            family = re.sub(r"_(total|sum|count)$", "", metric)
            assert metric in declared or family in declared, metric


def test_the_example_service_and_its_profile_load() -> None:
    from pathlib import Path

    import yaml

    from tandem.operator.autoscaler.planner import config_for
    from tandem.operator.autoscaler.profile import PROFILE_KEY
    from tandem.operator.spec.inference_service import load_inference_service

    root = Path(__file__).resolve().parents[2]
    cm, body = yaml.safe_load_all((root / "examples/slo-planner.yaml").read_text())
    profile = EngineProfile.from_dict(json.loads(cm["data"][PROFILE_KEY]))
    cfg = config_for(load_inference_service(body), profile)
    assert cfg.slo == SloTarget(0.6, 0.025, 0.99)
    assert (cfg.prefill_bounds, cfg.decode_bounds) == (Bounds(1, 16), Bounds(1, 8))
