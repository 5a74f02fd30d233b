"""Load + engine profile + latency SLO -> prefill and decode replicas. Pure.

The model (written out in ``docs/autoscaling.md``) follows DistServe's placement analysis and
Dynamo's SLA planner: prefill and decode are two queues with different bottlenecks, so each
pool is sized against the SLO term it controls.

* **Prefill** decides the time to first token. One engine serves prompts roughly one at a
  time, each taking ``D = isl / prefill_tps(isl)``; arrivals are Poisson. Kingman's
  approximation gives the waiting time's tail ``P(W > t) ~= rho * exp(-2 (1 - rho) t /
  (D (1 + cs2)))`` (``cs2``: squared coefficient of variation of ``D``, from the prompt
  lengths), so the largest utilisation ``rho`` with ``P(D + W > ttft) <= 1 - attainment``
  fixes each replica's request rate, ``rho / D``.
* **Decode** decides the inter-token latency. A step over ``b`` sequences of context ``c``
  takes ``step(b, c)``; a request's ITL is the step time of the batches it rides in. The
  largest batch ``b*`` whose step meets the ITL target (and fits the KV cache) is the hard
  limit; the number of sequences on one engine is Poisson-like around its mean ``m``, so
  ``m`` is chosen with ``m + z * sqrt(m) <= b*`` (``z`` the normal quantile of the
  attainment). Each replica then generates ``m / step(m, c)`` tokens/s, and the pool needs
  ``rate * osl`` of them.

A replica asked for now serves only after the engine's start-up, so each pool is also sized
for the load one start-up ahead (the rate's rising trend, or a ``surge`` allowance for a step
no trend announces) at the SLO *limit* (:class:`Headroom`, :func:`recommend`): a pool past its
limit misses nearly every request, not the tail.

Live measurements correct the profile (:func:`correction`): the ratio of measured to
predicted latency scales the profile's times, as Dynamo's planner does.

:func:`stabilize` turns one recommendation into the replicas to set: scale up at once, scale
down only past a hysteresis margin and to the highest recommendation of a stabilisation
window, so a noisy load does not make pools flap (each flap is a cold engine start).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any


def _interp(xs: Sequence[float], ys: Sequence[float], x: float, flat: bool = False) -> float:
    """Piecewise-linear through the points, extrapolated linearly past both ends (or held at
    the end values with ``flat``)."""
    if len(xs) == 1:
        return ys[0]
    if flat and not xs[0] <= x <= xs[-1]:
        return ys[0] if x < xs[0] else ys[-1]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class EngineProfile:
    """One engine replica's measured performance (``bench/`` writes it; a ConfigMap holds it).

    ``prefill_tps[i]`` is prefill throughput in tokens/s for a prompt of ``prefill_isl[i]``
    tokens; ``decode_step_s[i][j]`` is one decode step's seconds for a batch of
    ``decode_batch[i]`` sequences whose context is ``decode_ctx[j]`` tokens.
    """

    prefill_isl: tuple[int, ...]
    prefill_tps: tuple[float, ...]
    decode_batch: tuple[int, ...]
    decode_ctx: tuple[int, ...]
    decode_step_s: tuple[tuple[float, ...], ...]
    kv_cache_tokens: int
    max_num_seqs: int
    source: str = ""
    startup_s: float = 60.0
    """Seconds from a replica's creation to its first served request (scheduling, image,
    model load): how far ahead of the load the planner must ask for one."""

    def prefill_seconds(self, isl: float) -> float:
        # throughput past the measured lengths is held, not extrapolated: a falling slope
        # would reach zero, a rising one promise what was never measured
        tps = _interp(self.prefill_isl, self.prefill_tps, isl, flat=True)
        return isl / tps

    def step_seconds(self, batch: float, ctx: float) -> float:
        """Bilinear in (batch, context); never below the smallest measured step."""
        by_ctx = [_interp(self.decode_ctx, row, ctx) for row in self.decode_step_s]
        floor = min(min(row) for row in self.decode_step_s)
        return max(_interp(self.decode_batch, by_ctx, batch), floor)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefillIsl": list(self.prefill_isl),
            "prefillTokensPerSecond": list(self.prefill_tps),
            "decodeBatch": list(self.decode_batch),
            "decodeContext": list(self.decode_ctx),
            "decodeStepSeconds": [list(r) for r in self.decode_step_s],
            "kvCacheTokens": self.kv_cache_tokens,
            "maxNumSeqs": self.max_num_seqs,
            "source": self.source,
            "startupSeconds": self.startup_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineProfile:
        return cls(
            prefill_isl=tuple(int(x) for x in d["prefillIsl"]),
            prefill_tps=tuple(float(x) for x in d["prefillTokensPerSecond"]),
            decode_batch=tuple(int(x) for x in d["decodeBatch"]),
            decode_ctx=tuple(int(x) for x in d["decodeContext"]),
            decode_step_s=tuple(tuple(float(x) for x in r) for r in d["decodeStepSeconds"]),
            kv_cache_tokens=int(d["kvCacheTokens"]),
            max_num_seqs=int(d["maxNumSeqs"]),
            source=str(d.get("source", "")),
            startup_s=float(d.get("startupSeconds", 60.0)),
        )


@dataclass(frozen=True)
class SloTarget:
    """``spec.slo`` in seconds: each request's TTFT and mean ITL, met by ``attainment`` of them."""

    ttft_s: float
    itl_s: float
    attainment: float = 0.99


@dataclass(frozen=True)
class Load:
    """What the proxy and engines measured over the last window."""

    rate: float
    """Requests per second arriving."""
    isl: float
    """Mean prompt tokens (after prefix-cache hits: the tokens prefill computes)."""
    osl: float
    """Mean output tokens."""
    isl_cv: float = 0.0
    """Coefficient of variation of the prompt lengths (0: all equal)."""
    prefill_backlog: float = 0.0
    """Prompts waiting in the prefill engines' queues now (their ``num_requests_waiting``)."""
    rate_trend: float = 0.0
    """How fast ``rate`` is changing, requests/s per second (its derivative over a window)."""
    decode_backlog: float = 0.0
    """Sequences waiting for a decode batch slot now (the decode engines' waiting requests)."""

    def scaled(self, factor: float) -> Load:
        return replace(self, rate=self.rate * factor)


@dataclass(frozen=True)
class Correction:
    """Measured / predicted latency per pool; 1 when the profile is exact."""

    prefill: float = 1.0
    decode: float = 1.0


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Recommendation:
    """Replicas each pool needs for a load, before bounds and stabilisation, and why."""

    prefill: int
    decode: int
    prefill_rate_per_replica: float
    """Requests/s one prefill replica takes within the TTFT target."""
    decode_tokens_per_replica: float
    """Output tokens/s one decode replica generates within the ITL target."""
    decode_batch: float
    """Mean sequences per decode replica that this sizing aims for."""
    feasible: bool
    """False when even an idle engine misses the SLO (prompt or step too slow for the target)."""


def correction(measured_s: float | None, predicted_s: float, limit: float = 4.0) -> float:
    """How much slower the engines run than the profile says, from one live measurement.

    Clamped to ``[1/limit, limit]``: one bad window must not size the cluster tenfold.
    """
    if measured_s is None or measured_s <= 0 or predicted_s <= 0:
        return 1.0
    return min(max(measured_s / predicted_s, 1.0 / limit), limit)


def prefill_utilisation(service_s: float, budget_s: float, miss: float, cs2: float) -> float:
    """Largest utilisation of one prefill replica whose TTFT misses ``budget_s`` at most
    ``miss`` of the time (Kingman's exponential waiting-time tail); 0 if the prompt alone
    takes longer than the budget."""
    slack = budget_s - service_s
    if slack <= 0:
        return 0.0

    def tail(rho: float) -> float:
        return rho * math.exp(-2.0 * (1.0 - rho) * slack / (service_s * (1.0 + cs2)))

    if tail(1.0 - 1e-9) <= miss:
        return 1.0 - 1e-9
    lo, hi = 0.0, 1.0
    for _ in range(60):  # tail() rises with rho: bisect to machine precision
        mid = (lo + hi) / 2
        if tail(mid) <= miss:
            lo = mid
        else:
            hi = mid
    return lo


def decode_batch_limit(profile: EngineProfile, itl_s: float, isl: float, osl: float, k: float):
    """Largest batch whose step (corrected by ``k``) meets ``itl_s`` and whose KV fits."""
    ctx = isl + osl / 2
    kv_fit = profile.kv_cache_tokens // max(1, math.ceil(isl + osl))
    top = max(0, min(profile.max_num_seqs, kv_fit))
    best = 0
    for b in range(1, top + 1):
        if profile.step_seconds(b, ctx) * k <= itl_s:
            best = b
        else:
            break  # step time grows with the batch
    return best


@dataclass(frozen=True)
class Headroom:
    """What the pools hold beyond the load measured now, because a replica asked for now
    serves only ``lead_s`` later: until then the running pools carry whatever arrives."""

    lead_s: float = 0.0
    """Start-up of a replica plus one control interval: the planner's blind time."""
    surge: float = 0.0
    """Relative rise of the request rate, within ``lead_s``, that the running pools absorb at
    the SLO limit (the median request still meets it). 1.0: the load may double."""
    drain_s: float = 60.0
    """A backlog counts as extra rate that clears it within this time."""


MEDIAN = 0.5  # the miss rate at the SLO limit: the typical request just meets the target


def recommend(
    load: Load,
    profile: EngineProfile,
    slo: SloTarget,
    corr: Correction = Correction(),
    headroom: Headroom = Headroom(),
) -> Recommendation:
    """Replicas of each pool that meet ``slo`` at ``load``; 0 for a pool with no load.

    Each pool gets the larger of two sizes:

    * the **target**: the SLO's attainment at the measured rate, plus each pool's backlog
      drained within ``drain_s`` (the arrival rate alone would size a pool that never
      catches up);
    * the **surge**: the SLO *limit* (the largest utilisation or batch at which the median
      request still meets it) at the rate plus the rise the pools must carry before a replica
      asked for now serves, ``lead_s`` later: the larger of the rising trend's
      (``rate_trend * lead_s``, a ramp) and ``surge * rate`` (a step, which no trend announces).
      A pool under its surge size would make *every* request miss through a start-up (a
      decode batch past its limit slows all its sequences), so this is the size below which a
      reactive planner cannot keep its promise.
    """
    miss = 1.0 - slo.attainment
    service = profile.prefill_seconds(load.isl) * corr.prefill
    cs2 = load.isl_cv**2
    rho = prefill_utilisation(service, slo.ttft_s, miss, cs2)
    per_prefill = rho / service if service > 0 else math.inf
    limit_prefill = prefill_utilisation(service, slo.ttft_s, MEDIAN, cs2) / service
    ctx = load.isl + load.osl / 2
    b_star = decode_batch_limit(profile, slo.itl_s, load.isl, load.osl, corr.decode)
    z = NormalDist().inv_cdf(slo.attainment)
    # mean batch m with m + z*sqrt(m) <= b*: the positive root of a quadratic in sqrt(m)
    m = ((-z + math.sqrt(z * z + 4 * b_star)) / 2) ** 2 if b_star > 0 else 0.0
    m = max(m, 1.0) if b_star > 0 else 0.0
    per_decode = m / (profile.step_seconds(m, ctx) * corr.decode) if m > 0 else 0.0
    limit_decode = b_star / (profile.step_seconds(b_star, ctx) * corr.decode) if m > 0 else 0.0
    feasible = rho > 0 and b_star > 0
    if load.rate <= 0 and load.prefill_backlog <= 0 and load.decode_backlog <= 0:
        return Recommendation(0, 0, per_prefill, per_decode, m, feasible)
    rate = load.rate
    # the rise the pools running now must carry until a replica asked for now serves: the
    # trend's (a ramp) or the surge allowance (a step, which no trend announces)
    rise = max(max(0.0, load.rate_trend) * headroom.lead_s, rate * headroom.surge)
    surge = rate + rise if rise > 0 else 0.0
    prefill = max(
        _replicas(rate + load.prefill_backlog / headroom.drain_s, per_prefill),
        _replicas(surge, limit_prefill),
    )
    decode_rate = rate + load.decode_backlog / headroom.drain_s
    decode = max(
        _replicas(decode_rate * load.osl, per_decode), _replicas(surge * load.osl, limit_decode)
    )
    return Recommendation(
        prefill=max(1, prefill),
        decode=max(1, decode),
        prefill_rate_per_replica=per_prefill,
        decode_tokens_per_replica=per_decode,
        decode_batch=m,
        feasible=feasible,
    )


def _replicas(demand: float, per_replica: float) -> int:
    """Replicas that each take ``per_replica`` of ``demand``; when one takes nothing (an
    infeasible SLO), as many as the bounds allow."""
    if demand <= 0:
        return 0
    return math.ceil(demand / per_replica - 1e-9) if per_replica > 0 else 1 << 30


@dataclass(frozen=True)
class Stabilization:
    """How recommendations become replica changes (the HPA's ``behavior``, for the planner)."""

    scale_down_window_s: float = 300.0
    """Scale down only to the highest recommendation of this window."""
    down_margin: float = 0.2
    """Hysteresis: scale down only if the pool would still suffice at this much more load."""


@dataclass(frozen=True)
class PoolState:
    """One pool's replicas and its recent recommendations ``(time, replicas)``, oldest first."""

    replicas: int
    history: tuple[tuple[float, int], ...] = ()


def stabilize(
    state: PoolState,
    now: float,
    at_load: int,
    at_margin: int,
    bounds: Bounds,
    cfg: Stabilization = Stabilization(),
) -> PoolState:
    """The next state of one pool from the replicas needed at the load (``at_load``) and at
    the load plus the hysteresis margin (``at_margin >= at_load``).

    Up: at once to ``at_load``. Down: only when ``at_margin`` is below the current count,
    and then to the highest ``at_margin`` seen within the window.
    """
    # A fresh state (operator start) remembers its current size as just recommended, so a
    # restart or an empty first window never drops a pool before a full window has passed.
    past = state.history or ((now, state.replicas),)
    history = tuple((t, n) for t, n in past if now - t < cfg.scale_down_window_s) + (
        (now, at_margin),
    )
    current = state.replicas
    if at_load > current:
        target = at_load
    elif at_margin < current:
        target = min(current, max(n for _, n in history))
    else:
        target = current
    return PoolState(bounds.clamp(target), history)


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
