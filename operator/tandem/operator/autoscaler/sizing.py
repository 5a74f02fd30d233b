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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import NormalDist

from .profile import EngineProfile


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
