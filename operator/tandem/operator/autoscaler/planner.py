"""One round of the SLO planner: both pools' replicas from a load, or from raw samples. Pure.

:func:`step` is the planner's arithmetic (``sizing.py``, then ``stabilization.py`` per pool);
:func:`decide` is the same round fed the metrics' samples, as the operator's loop
(``loop.py``) and ``bench/autoscale.py --cluster`` run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.inference_service import InferenceService
from .metrics import load_from_samples, measured_correction
from .profile import EngineProfile
from .sizing import Correction, Headroom, Load, Recommendation, SloTarget, recommend
from .stabilization import Bounds, PoolState, Stabilization, stabilize


@dataclass(frozen=True)
class PlannerState:
    prefill: PoolState
    decode: PoolState


@dataclass(frozen=True)
class PlannerConfig:
    slo: SloTarget
    profile: EngineProfile
    prefill_bounds: Bounds
    decode_bounds: Bounds
    stabilization: Stabilization = Stabilization()
    interval_s: float = 15.0
    """The control interval: a load change is seen up to this late."""
    surge: float = 0.75
    """:attr:`Headroom.surge`: the rate rise the running pools absorb during a start-up."""

    def headroom(self) -> Headroom:
        return Headroom(lead_s=self.profile.startup_s + self.interval_s, surge=self.surge)


def step(
    state: PlannerState, now: float, load: Load, cfg: PlannerConfig, corr: Correction = Correction()
) -> tuple[PlannerState, Recommendation]:
    """One planning round: the replicas both pools should run now, and the raw recommendation."""
    rec = recommend(load, cfg.profile, cfg.slo, corr, cfg.headroom())
    margin = recommend(
        load.scaled(1.0 + cfg.stabilization.down_margin), cfg.profile, cfg.slo, corr, cfg.headroom()
    )
    return (
        PlannerState(
            prefill=stabilize(
                state.prefill,
                now,
                rec.prefill,
                margin.prefill,
                cfg.prefill_bounds,
                cfg.stabilization,
            ),
            decode=stabilize(
                state.decode, now, rec.decode, margin.decode, cfg.decode_bounds, cfg.stabilization
            ),
        ),
        rec,
    )


@dataclass(frozen=True)
class Decision:
    state: PlannerState
    prefill: int
    decode: int
    load: Load


def config_for(isvc: InferenceService, profile: EngineProfile) -> PlannerConfig:
    spec = isvc.spec
    assert spec.slo is not None and spec.prefill is not None
    pa, da = spec.prefill.autoscaling, spec.decode.autoscaling
    assert pa is not None and da is not None
    return PlannerConfig(
        slo=SloTarget(spec.slo.ttft_ms / 1000, spec.slo.itl_ms / 1000, spec.slo.attainment),
        profile=profile,
        prefill_bounds=Bounds(pa.min_replicas, pa.max_replicas),
        decode_bounds=Bounds(da.min_replicas, da.max_replicas),
        surge=spec.slo.surge,
    )


def decide(
    state: PlannerState | None,
    now: float,
    samples: dict[str, float | None],
    cfg: PlannerConfig,
    current: tuple[int, int],
) -> Decision:
    """One round, pure: from the previous state (None: start from the current replicas)."""
    state = state or PlannerState(PoolState(current[0]), PoolState(current[1]))
    load = load_from_samples(samples)
    corr = measured_correction(samples, load, cfg.profile, cfg.slo)
    state, _ = step(state, now, load, cfg, corr)
    return Decision(state, state.prefill.replicas, state.decode.replicas, load)
