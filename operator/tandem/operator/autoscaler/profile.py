"""An engine replica's measured performance: what the planner's queueing model is fed.

``bench/profile_engine.py`` measures it; a ConfigMap holds it as JSON under
:data:`PROFILE_KEY`; :meth:`EngineProfile.prefill_seconds` and
:meth:`EngineProfile.step_seconds` interpolate between the measured points.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PROFILE_KEY = "profile.json"
"""The ConfigMap key (``spec.slo.profileConfigMap``) that holds the profile."""


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
