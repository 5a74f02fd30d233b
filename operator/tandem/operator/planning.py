"""The ``Planner`` backend's loop: live metrics in, both pools' replicas out.

Every control interval the operator reads, from the Prometheus that scrapes the chart's
PodMonitor, what the planner needs (:data:`QUERIES`), turns it into a :class:`Load`
(:func:`load_from_samples`, pure), lets :func:`tandem.operator.planner.step` decide, and writes
the two Deployments' scale subresources. The planner's state (its stabilisation window) is
kept per InferenceService by the caller; losing it on a restart only restarts the window.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from .planner import (
    Bounds,
    Correction,
    EngineProfile,
    Load,
    PlannerConfig,
    PlannerState,
    PoolState,
    SloTarget,
    correction,
    recommend,
    step,
)
from .spec.inference_service import InferenceService

PROFILE_KEY = "profile.json"
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


def prometheus_query(address: str, query: str, timeout: float = 10.0) -> float | None:
    """One instant query's scalar (the first sample), None when it has no series."""
    url = f"{address.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (configured URL)
        body: dict[str, Any] = json.load(resp)
    result = body.get("data", {}).get("result") or []
    return float(result[0]["value"][1]) if result else None


def read_samples(address: str, namespace: str, instance: str) -> dict[str, float | None]:
    return {k: prometheus_query(address, q) for k, q in queries(namespace, instance).items()}


def _scale_path(namespace: str, deployment: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"


def run_planner(
    kube: Any, isvc: InferenceService, state: PlannerState | None, now: float
) -> Decision:
    """One round against the cluster: read the profile and the metrics, decide, set the
    scale of both pools (only when it changes). ``kube`` is a :class:`~.kube.Kube`."""
    spec, ns, name = isvc.spec, isvc.metadata.namespace, isvc.metadata.name
    assert spec.slo is not None and spec.prefill is not None and spec.prefill.autoscaling
    cm = kube.request("GET", f"/api/v1/namespaces/{ns}/configmaps/{spec.slo.profile_config_map}")
    profile = EngineProfile.from_dict(json.loads(cm["data"][PROFILE_KEY]))
    samples = read_samples(spec.prefill.autoscaling.prometheus_address, ns, name)
    pools = (f"{name}-prefill", f"{name}-decode")
    scales = [kube.request("GET", _scale_path(ns, p)) for p in pools]
    current = tuple(int((s.get("spec") or {}).get("replicas") or 0) for s in scales)
    decision = decide(state, now, samples, config_for(isvc, profile), (current[0], current[1]))
    for pool, have, want in zip(pools, current, (decision.prefill, decision.decode), strict=True):
        if have != want:
            kube.request(
                "PATCH",
                _scale_path(ns, pool),
                {"spec": {"replicas": want}},
                content_type="application/merge-patch+json",
            )
    return decision
