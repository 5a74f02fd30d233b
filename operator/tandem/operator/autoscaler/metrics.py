"""What the planner reads from Prometheus, and the load it makes of it. Pure.

The queries select series by the labels the chart's PodMonitor attaches (:func:`queries`);
:func:`load_from_samples` turns their results into a :class:`~.sizing.Load`, and
:func:`measured_correction` compares the measured latency with the profile's.
"""

from __future__ import annotations

import math

from .profile import EngineProfile
from .sizing import Correction, Load, SloTarget, correction, recommend

WINDOW = "1m"


def queries(namespace: str, instance: str) -> dict[str, str]:
    """PromQL for each input, selected by the labels the chart's PodMonitor attaches."""
    sel = f'namespace="{namespace}",tandem_dev_inferenceservice="{instance}"'
    pre, dec = f'{sel},tandem_dev_role="prefill"', f'{sel},tandem_dev_role="decode"'
    return {
        # requests reaching the service (the proxy counts each one once)
        "rate": f"sum(rate(tandem_proxy_requests_total{{{sel}}}[{WINDOW}]))",
        # prompt tokens prefill computes, output tokens decode generates, requests finished
        "prompt_tokens": f"sum(rate(tandem:prompt_tokens_total{{{pre}}}[{WINDOW}]))",
        "output_tokens": f"sum(rate(tandem:generation_tokens_total{{{dec}}}[{WINDOW}]))",
        "finished": f"sum(rate(tandem:request_success_total{{{dec}}}[{WINDOW}]))",
        # the request rate's derivative over the last 5 minutes (a ramp to plan ahead for)
        "trend": (f"deriv(sum(rate(tandem_proxy_requests_total{{{sel}}}[{WINDOW}]))[5m:15s])"),
        "backlog": f"sum(tandem:num_requests_waiting{{{pre}}})",
        "decode_backlog": f"sum(tandem:num_requests_waiting{{{dec}}})",
        # measured latency, to correct the profile
        "ttft": (
            f"sum(rate(tandem:time_to_first_token_seconds_sum{{{pre}}}[{WINDOW}])) / "
            f"sum(rate(tandem:time_to_first_token_seconds_count{{{pre}}}[{WINDOW}]))"
        ),
        "itl": (
            f"sum(rate(tandem:inter_token_latency_seconds_sum{{{dec}}}[{WINDOW}])) / "
            f"sum(rate(tandem:inter_token_latency_seconds_count{{{dec}}}[{WINDOW}]))"
        ),
    }


def load_from_samples(samples: dict[str, float | None]) -> Load:
    """The planner's input from the query results (None: no series, e.g. a pool at zero)."""

    def get(key: str) -> float:
        v = samples.get(key)
        return 0.0 if v is None or math.isnan(v) else v

    rate = get("rate")
    prompt, output, finished = get("prompt_tokens"), get("output_tokens"), get("finished")
    return Load(
        rate=rate,
        isl=prompt / rate if rate > 0 and prompt > 0 else 1.0,
        osl=output / finished if finished > 0 and output > 0 else 1.0,
        prefill_backlog=get("backlog"),
        rate_trend=get("trend"),
        decode_backlog=get("decode_backlog"),
    )


def measured_correction(
    samples: dict[str, float | None], load: Load, profile: EngineProfile, slo: SloTarget
) -> Correction:
    """Measured / predicted mean latency per pool at the current load."""
    if load.rate <= 0:
        return Correction()
    rec = recommend(load, profile, slo)
    ctx = load.isl + load.osl / 2
    return Correction(
        prefill=correction(samples.get("ttft"), profile.prefill_seconds(load.isl)),
        decode=correction(samples.get("itl"), profile.step_seconds(rec.decode_batch, ctx)),
    )
