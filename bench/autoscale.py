"""Autoscaling policies replayed on a simulated P/D cluster: SLO attainment and GPU-hours.

    python bench/autoscale.py [--profile PROFILE.json] [--seed 0] [--cluster]

Two load traces (a step, and a compressed diurnal ramp; Poisson arrivals, log-normal prompt
and output lengths) are replayed against a discrete-event model of a disaggregated
cluster, under three policies:

* ``fixed-peak``: both pools sized once for the trace's peak rate (by the planner's own
  arithmetic, so the baseline meets the SLO at the peak);
* ``hpa-queue``: Kubernetes HPA arithmetic on each pool's per-pod waiting requests (the
  ``tandem:num_requests_waiting`` metric of today's HPA), 10% tolerance, 300 s scale-down
  stabilisation, swept over the target value and over ``minReplicas`` (the knob that buys an
  HPA GPU-hours: its queue signal is zero below saturation, whatever the target), so that its
  attainment can be read at the planner's GPU-hours;
* ``slo-planner``: ``tandem.operator.autoscaler.planner.step`` (the operator's code) every control
  interval, fed the measured arrival rate and lengths.

The cluster model: a prefill engine runs one prompt at a time for ``isl / tps(isl)``; the
proxy sends each prompt to the prefill engine that frees up first. A decode engine runs
continuous batching: all its sequences advance one token per step of ``step(b, ctx)``
seconds (a fluid model, exact between arrivals and departures), at most ``max_num_seqs``
sequences and the KV cache's worth at once; the rest wait. A new replica serves after
``--startup`` seconds (model load) and is paid for from its request; a removed replica stops
taking work and is paid for until its last request leaves. A request meets the SLO when its
TTFT and its mean inter-token latency both meet the targets.

The default profile is synthetic (stated in ``SYNTHETIC``: shaped like an 8B model on one
H100, not measured here); ``--profile`` takes a JSON profile (``EngineProfile.to_dict``),
such as one ``bench/profile_engine.py`` measures on a real engine.

``--cluster`` replays the planner once more with its replica changes made on a real control
plane (``e2e/``: kube-apiserver, controller manager, scheduler, kwok GPU nodes, and the
operator with ``--no-planner``): at every tick the operator's own planning round
(``autoscaler.loop.run_planner``, via ``e2e/pools.py``) reads the simulated load from a stand-in
for Prometheus and patches both pools' scale; the simulated pools then follow the pods that
the cluster actually made Ready (each serving ``--startup`` seconds later: kwok loads no model).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "server"), str(ROOT)]

from tandem.operator.autoscaler.planner import PlannerConfig, PlannerState, step  # noqa: E402
from tandem.operator.autoscaler.profile import EngineProfile  # noqa: E402
from tandem.operator.autoscaler.sizing import Load, SloTarget, recommend  # noqa: E402
from tandem.operator.autoscaler.stabilization import Bounds, PoolState  # noqa: E402


def _synthetic() -> EngineProfile:
    batches = (1, 8, 16, 32, 64, 128, 256)
    ctxs = (256, 1024, 4096)
    # step = fixed weight read + per-sequence compute + per-token attention reads
    rows = tuple(tuple(0.008 + 1.2e-4 * b + 4e-8 * b * c for c in ctxs) for b in batches)
    return EngineProfile(
        prefill_isl=(64, 256, 1024, 4096, 16384),
        prefill_tps=(3000.0, 8000.0, 12000.0, 11000.0, 8000.0),
        decode_batch=batches,
        decode_ctx=ctxs,
        decode_step_s=rows,
        kv_cache_tokens=300_000,
        max_num_seqs=256,
        source="synthetic: roofline-shaped, 8B-class model on one H100; not a measurement",
    )


SYNTHETIC = _synthetic()


# ---------------------------------------------------------------- traces ----------------------


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    low: float
    high: float
    rate: Callable[[float], float]
    isl_mean: float = 1500.0
    isl_cv: float = 0.6
    osl_mean: float = 300.0
    osl_cv: float = 0.8


def step_trace(low: float, high: float) -> Trace:
    """Low for 30 min, high (a surge) for 60 min, low for 30 min."""
    return Trace("step", 7200.0, low, high, lambda t: high if 1800.0 <= t < 5400.0 else low)


def diurnal_trace(low: float, high: float) -> Trace:
    """One day compressed into 2 h: a cosine from ``low`` at night to ``high`` at noon."""
    return Trace(
        "diurnal",
        7200.0,
        low,
        high,
        lambda t: low + (high - low) * (1 - math.cos(2 * math.pi * t / 7200.0)) / 2,
    )


def _lognormal(rng: random.Random, mean: float, cv: float) -> float:
    sigma2 = math.log(1 + cv * cv)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


@dataclass
class Req:
    arrival: float
    isl: int
    osl: int
    prefill_done: float = 0.0
    finish: float = 0.0


def requests(trace: Trace, peak: float, seed: int) -> list[Req]:
    """Non-homogeneous Poisson arrivals by thinning."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= trace.duration_s:
            return out
        if rng.random() * peak <= trace.rate(t):
            isl = min(4096, max(16, round(_lognormal(rng, trace.isl_mean, trace.isl_cv))))
            osl = min(2048, max(2, round(_lognormal(rng, trace.osl_mean, trace.osl_cv))))
            out.append(Req(t, isl, osl))


# ---------------------------------------------------------------- the cluster -----------------


@dataclass
class Replica:
    created: float
    ready_at: float
    draining: bool = False
    drained_at: float | None = None  # when it left (its last work done)


@dataclass
class PrefillEngine(Replica):
    free_at: float = 0.0
    queue: list[float] = field(default_factory=list)  # start times of accepted prompts


@dataclass
class DecodeEngine(Replica):
    v: float = 0.0  # token clock: tokens each running sequence has produced
    t: float = 0.0  # when v was last advanced
    running: list[tuple[float, int]] = field(default_factory=list)  # heap (finish v, req id)
    waiting: list[int] = field(default_factory=list)
    version: int = 0
    kv: float = 0.0  # KV tokens the running sequences will hold at their end
    ctx: float = 0.0  # sum of the running sequences' mean contexts


class Cluster:
    """Both pools, their replicas' lives, and the GPU-seconds they cost."""

    def __init__(self, profile: EngineProfile, startup_s: float, p0: int, d0: int) -> None:
        self.profile = profile
        self.startup_s = startup_s
        self.prefill: list[PrefillEngine] = [PrefillEngine(0.0, 0.0) for _ in range(p0)]
        self.decode: list[DecodeEngine] = [DecodeEngine(0.0, 0.0) for _ in range(d0)]

    def live(self, pool: list) -> list:
        return [e for e in pool if not e.draining]

    def resize(self, pool: list, n: int, now: float, make: Callable[[float, float], Replica]):
        live = self.live(pool)
        for _ in range(n - len(live)):
            pool.append(make(now, now + self.startup_s))
        if n < len(live):
            # drop the ones not ready yet first (cheapest), then the least loaded
            victims = sorted(live, key=lambda e: (e.ready_at <= now, self._load(e, now)))
            for e in victims[: len(live) - n]:
                e.draining = True
                if self._load(e, now) == 0:
                    e.drained_at = now

    def _load(self, e: Replica, now: float) -> float:
        if isinstance(e, PrefillEngine):
            return max(0.0, e.free_at - now)
        assert isinstance(e, DecodeEngine)
        return len(e.running) + len(e.waiting)

    def gpu_seconds(self, end: float) -> float:
        total = 0.0
        for e in [*self.prefill, *self.decode]:
            stop = e.drained_at if e.drained_at is not None else end
            total += max(0.0, min(stop, end) - e.created)
        return total


# ---------------------------------------------------------------- policies --------------------


@dataclass
class Observed:
    """What the metrics pipeline shows a policy at a control tick."""

    now: float
    recent: list[Req]  # arrivals in the last window
    window_s: float
    before: int  # arrivals in the window before that
    last_tick: int  # arrivals in the last control interval
    tick_s: float
    prefill_waiting: float  # mean waiting prompts per ready prefill replica
    prefill_backlog: int  # waiting prompts on all prefill replicas
    decode_waiting: float  # mean waiting sequences per ready decode replica
    decode_backlog: int  # waiting sequences on all decode replicas
    prefill_replicas: int
    decode_replicas: int


Policy = Callable[[Observed], tuple[int, int]]


def measured_load(obs: Observed) -> Load:
    if not obs.recent:
        return Load(0.0, 1.0, 1.0)
    isl = [r.isl for r in obs.recent]
    mean = sum(isl) / len(isl)
    var = sum((x - mean) ** 2 for x in isl) / len(isl)
    # the faster of the two windows: up at once on a burst, down smoothly
    return Load(
        rate=max(len(obs.recent) / obs.window_s, obs.last_tick / obs.tick_s),
        isl=mean,
        osl=sum(r.osl for r in obs.recent) / len(obs.recent),
        isl_cv=math.sqrt(var) / mean,
        prefill_backlog=obs.prefill_backlog,
        # the rate's change from the previous window to the last (PromQL's deriv())
        rate_trend=(len(obs.recent) - obs.before) / obs.window_s**2
        if obs.now >= 2 * obs.window_s
        else 0.0,
        decode_backlog=obs.decode_backlog,
    )


def fixed(p: int, d: int) -> Policy:
    return lambda obs: (p, d)


def hpa_queue(target: float, prefill: Bounds, decode: Bounds, window_s: float = 300.0) -> Policy:
    """The HPA's replica arithmetic on an AverageValue Pods metric, per pool."""
    bounds = {"p": prefill, "d": decode}
    history: dict[str, list[tuple[float, int]]] = {"p": [], "d": []}

    def one(key: str, current: int, value: float, now: float) -> int:
        ratio = value / target
        desired = current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)
        desired = bounds[key].clamp(
            min(desired, max(2 * current, current + 4))
        )  # default scale-up policy
        h = [(t, n) for t, n in history[key] if now - t < window_s] + [(now, desired)]
        history[key] = h
        return desired if desired >= current else max(n for _, n in h)

    return lambda obs: (
        one("p", obs.prefill_replicas, obs.prefill_waiting, obs.now),
        one("d", obs.decode_replicas, obs.decode_waiting, obs.now),
    )


def slo_planner(cfg: PlannerConfig, p0: int, d0: int) -> Policy:
    state = PlannerState(PoolState(p0), PoolState(d0))

    def decide(obs: Observed) -> tuple[int, int]:
        nonlocal state
        state, _ = step(state, obs.now, measured_load(obs), cfg)
        return state.prefill.replicas, state.decode.replicas

    return decide


# ---------------------------------------------------------------- the simulation --------------


@dataclass(frozen=True)
class Result:
    attainment: float
    ttft_attainment: float
    itl_attainment: float
    gpu_hours: float
    peak_replicas: int


def simulate(
    reqs: list[Req],
    duration_s: float,
    policy: Policy,
    p0: int,
    d0: int,
    slo: SloTarget,
    profile: EngineProfile,
    startup_s: float,
    tick_s: float = 15.0,
    window_s: float = 60.0,
) -> Result:
    reqs = [Req(r.arrival, r.isl, r.osl) for r in reqs]
    cl = Cluster(profile, startup_s, p0, d0)
    events: list[tuple[float, int, int, int, int]] = []  # (time, kind, a, b, c)
    ARRIVE, JOIN, DONE, TICK = 0, 1, 2, 3
    for i, r in enumerate(reqs):
        events.append((r.arrival, ARRIVE, i, 0, 0))
    t = 0.0
    while t < duration_s:
        events.append((t, TICK, 0, 0, 0))
        t += tick_s
    heapq.heapify(events)
    max_batch = min(profile.max_num_seqs, profile.kv_cache_tokens)
    peak = p0 + d0
    recent_from = 0

    def advance(e: DecodeEngine, now: float) -> None:
        if e.running and now > e.t:
            e.v += (now - e.t) / profile.step_seconds(len(e.running), e.ctx / len(e.running))
        e.t = now

    def admit_and_schedule(e: DecodeEngine, now: float) -> None:
        while e.waiting and len(e.running) < max_batch:
            r = reqs[e.waiting[0]]
            if e.running and e.kv + r.isl + r.osl > profile.kv_cache_tokens:
                break
            heapq.heappush(e.running, (e.v + r.osl, e.waiting.pop(0)))
            e.kv += r.isl + r.osl
            e.ctx += r.isl + r.osl / 2
        e.version += 1
        if e.running:
            step_s = profile.step_seconds(len(e.running), e.ctx / len(e.running))
            dt = (e.running[0][0] - e.v) * step_s
            heapq.heappush(events, (now + dt, DONE, id(e), e.version, 0))
        elif e.draining and e.drained_at is None:
            e.drained_at = now

    by_id: dict[int, DecodeEngine] = {}
    while events:
        now, kind, a, b, _ = heapq.heappop(events)
        if kind == ARRIVE:
            r = reqs[a]
            ready = [e for e in cl.prefill if not e.draining and e.ready_at <= now]
            if not ready:  # none serving yet: the one that will be ready first
                ready = [min(cl.live(cl.prefill), key=lambda e: e.ready_at)]
            e = min(ready, key=lambda e: max(e.free_at, e.ready_at, now))
            start = max(e.free_at, e.ready_at, now)
            e.free_at = start + profile.prefill_seconds(r.isl)
            e.queue.append(start)
            r.prefill_done = e.free_at
            heapq.heappush(events, (r.prefill_done, JOIN, a, 0, 0))
        elif kind == JOIN:
            ready = [e for e in cl.decode if not e.draining and e.ready_at <= now]
            if not ready:
                ready = [min(cl.live(cl.decode), key=lambda e: e.ready_at)]
            e = min(ready, key=lambda e: len(e.running) + len(e.waiting))
            by_id[id(e)] = e
            advance(e, max(now, e.t))
            e.waiting.append(a)
            if e.ready_at <= now:
                admit_and_schedule(e, now)
            else:
                heapq.heappush(events, (e.ready_at, DONE, id(e), -1, 0))
        elif kind == DONE:
            e = by_id[a]
            if b != -1 and b != e.version:
                continue  # superseded by a later change to this engine
            advance(e, now)
            if b != -1 and e.running:  # the head's finish this event was scheduled for:
                e.v = max(e.v, e.running[0][0])  # exact, whatever the float rounding of now
            while e.running and e.running[0][0] <= e.v + 1e-6:
                _, i = heapq.heappop(e.running)
                reqs[i].finish = now
                e.kv -= reqs[i].isl + reqs[i].osl
                e.ctx -= reqs[i].isl + reqs[i].osl / 2
            admit_and_schedule(e, now)
        else:  # TICK
            while recent_from < len(reqs) and reqs[recent_from].arrival < now - 2 * window_s:
                recent_from += 1
            both = [r for r in reqs[recent_from:] if r.arrival < now]
            recent = [r for r in both if r.arrival >= now - window_s]
            p_ready = [e for e in cl.live(cl.prefill) if e.ready_at <= now]
            d_ready = [e for e in cl.live(cl.decode) if e.ready_at <= now]
            for e in p_ready:
                e.queue = [s for s in e.queue if s > now]
            for e in cl.prefill:
                if e.draining and e.drained_at is None and e.free_at <= now:
                    e.drained_at = max(e.free_at, e.created)
            obs = Observed(
                now,
                recent,
                window_s,
                len(both) - len(recent),
                sum(1 for r in recent if r.arrival >= now - tick_s),
                tick_s,
                sum(len(e.queue) for e in p_ready) / max(1, len(p_ready)),
                sum(len(e.queue) for e in p_ready),
                sum(len(e.waiting) for e in d_ready) / max(1, len(d_ready)),
                sum(len(e.waiting) for e in d_ready),
                len(cl.live(cl.prefill)),
                len(cl.live(cl.decode)),
            )
            p, d = policy(obs)
            cl.resize(cl.prefill, p, now, lambda c, r: PrefillEngine(c, r))
            cl.resize(cl.decode, d, now, lambda c, r: DecodeEngine(c, r, t=r))
            peak = max(peak, p + d)
    end = max(duration_s, max(r.finish for r in reqs))
    ok_ttft = [r.prefill_done - r.arrival <= slo.ttft_s for r in reqs]
    ok_itl = [(r.finish - r.prefill_done) / r.osl <= slo.itl_s for r in reqs]
    n = len(reqs)
    return Result(
        attainment=sum(a and b for a, b in zip(ok_ttft, ok_itl, strict=True)) / n,
        ttft_attainment=sum(ok_ttft) / n,
        itl_attainment=sum(ok_itl) / n,
        gpu_hours=cl.gpu_seconds(end) / 3600.0,
        peak_replicas=peak,
    )


# ---------------------------------------------------------------- the real control plane ------


def samples_for(load: Load) -> dict[str, float | None]:
    """What Prometheus would answer the operator's planner queries at this load (the
    engines here are the profile, so no measured latency corrects it)."""
    return {
        "rate": load.rate,
        "prompt_tokens": load.rate * load.isl,
        "output_tokens": load.rate * load.osl,
        "finished": load.rate,
        "backlog": load.prefill_backlog,
        "trend": load.rate_trend,
        "decode_backlog": load.decode_backlog,
        "ttft": None,
        "itl": None,
    }


def cluster_planner(pools: Any) -> Policy:
    """The operator's planning round on the real cluster at the simulation's clock; the
    simulated pools follow the pods the cluster actually made Ready."""

    def decide(obs: Observed) -> tuple[int, int]:
        pools.round(obs.now, samples_for(measured_load(obs)))
        ready = pools.settle()
        if ready != pools.desired():
            print(f"  t={obs.now:.0f} s: {ready} Ready of {pools.desired()} asked", flush=True)
        return ready

    return decide


@contextmanager
def real_cluster(gpus: int) -> Iterator[tuple[Any, str]]:
    """A control plane from e2e/ (kwok nodes with ``gpus`` GPUs in all), the CRD, and the
    operator with its own planner loop off; yields the cluster and a namespace."""
    from e2e.cluster import Cluster, NodeShape, missing_binaries, wait_for
    from e2e.cluster.paths import bin_dir
    from e2e.pools import start_operator

    missing = missing_binaries(bin_dir())
    if missing:
        raise SystemExit(f"--cluster needs the e2e binaries ({missing}): bash e2e/setup.sh")
    state = Path(tempfile.mkdtemp(prefix="tandem-autoscale-"))
    cluster = Cluster(state, nodes=NodeShape(count=max(1, math.ceil(gpus / 8))))
    cluster.start()
    operator = None
    try:
        crd = ROOT / "crds/inferenceservices.tandem.dev.yaml"
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
        established = '{.status.conditions[?(@.type=="Established")].status}'
        wait_for(
            "the InferenceService CRD",
            lambda: (
                cluster.kubectl(
                    "get",
                    "crd",
                    "inferenceservices.tandem.dev",
                    f"-o=jsonpath={established}",
                    check=False,
                ).stdout
                == "True"
            ),
            timeout=120,
        )
        namespace = "autoscale"
        cluster.kubectl("create", "namespace", namespace)
        operator = start_operator(cluster, namespace, state / "operator.log")
        print(f"cluster: control plane up in {cluster.startup_seconds:.0f} s (state {state})")
        yield cluster, namespace
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=30)
        cluster.stop()


def on_cluster(
    cluster: Any, namespace: str, trace: Trace, reqs: list[Req], cfg: PlannerConfig, sim: dict
) -> Result:
    """The planner policy replayed with its replica changes made on the real cluster."""
    from e2e.pools import PlannerPools, PoolSpec

    spec = PoolSpec(
        cfg.slo.ttft_s * 1000,
        cfg.slo.itl_s * 1000,
        cfg.profile,
        cfg.prefill_bounds.max_replicas,
        cfg.decode_bounds.max_replicas,
        cfg.surge,
    )
    pools = PlannerPools(cluster, namespace, f"trace-{trace.name}", spec)
    try:
        pools.wait_for_pools()
        # size for the trace's first load before it starts, as the simulated policies are
        first = Load(trace.rate(0.0), trace.isl_mean, trace.osl_mean)
        pools.round(-2 * 60.0, samples_for(first))
        p0, d0 = pools.settle()
        return simulate(reqs, trace.duration_s, cluster_planner(pools), p0, d0, **sim)
    finally:
        pools.stop()


# ---------------------------------------------------------------- main ------------------------


def equal_cost(plan: Result, hpa: list[tuple[str, Result]]) -> tuple[str, float | None]:
    """The queue HPA's attainment at the planner's GPU-hours: the best of the HPA runs that
    spend at most as much (a cheaper run could idle the difference away, so this is what the
    HPA reaches at equal cost); None when every run spends more."""
    cheaper = [h for h in hpa if h[1].gpu_hours <= plan.gpu_hours]
    if not cheaper:
        return "every HPA run spends more GPU-hours", None
    name, best = max(cheaper, key=lambda h: (h[1].attainment, -h[1].gpu_hours))
    return f"{name}, {best.gpu_hours / plan.gpu_hours:.2f}x the planner's GPU-hours", (
        best.attainment
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", type=Path, help="EngineProfile JSON (default: synthetic)")
    parser.add_argument("--ttft-ms", type=float, default=600.0)
    parser.add_argument("--itl-ms", type=float, default=25.0)
    parser.add_argument("--low", type=float, default=3.0, help="requests/s at the trough")
    parser.add_argument("--high", type=float, default=30.0, help="requests/s at the peak")
    parser.add_argument("--step-low", type=float, default=15.0, help="req/s before the step")
    parser.add_argument("--startup", type=float, default=45.0, help="seconds to a ready replica")
    parser.add_argument(
        "--surge",
        type=float,
        default=PlannerConfig.surge,
        help="rate rise the pools absorb during a start-up (spec.slo.surge)",
    )
    parser.add_argument("--max-replicas", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default="4", help="HPA targetAverageValue sweep")
    parser.add_argument(
        "--floors",
        default="0,0.5,0.75,0.9",
        help="HPA minReplicas sweep, as fractions of the peak sizing (buys GPU-hours)",
    )
    parser.add_argument("--traces", default="step,diurnal", help="which traces to replay")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="also replay the planner with its replica changes made on a real control plane "
        "(e2e/: kube-apiserver, controllers, kwok GPU nodes, the operator)",
    )
    args = parser.parse_args()

    profile = (
        EngineProfile.from_dict(json.loads(args.profile.read_text())) if args.profile else SYNTHETIC
    )
    slo = SloTarget(args.ttft_ms / 1000.0, args.itl_ms / 1000.0)
    bounds = Bounds(1, args.max_replicas)
    profile = replace(profile, startup_s=args.startup)  # what the planner plans ahead for
    cfg = PlannerConfig(slo, profile, bounds, bounds, surge=args.surge)
    print(f"profile: {profile.source}")
    print(f"SLO: TTFT <= {args.ttft_ms:g} ms and mean ITL <= {args.itl_ms:g} ms per request")
    print(
        f"replica startup {args.startup:g} s; control interval 15 s; rate window 60 s; "
        f"planner surge {args.surge:g}\n"
    )
    with ExitStack() as stack:
        real = stack.enter_context(real_cluster(2 * args.max_replicas)) if args.cluster else None
        goal_met = True
        for name in args.traces.split(","):
            trace = (
                step_trace(args.step_low, args.high)
                if name == "step"
                else diurnal_trace(args.low, args.high)
            )
            goal_met = replay(trace, args, profile, slo, cfg, real) and goal_met
    return 0 if goal_met else 1


def replay(
    trace: Trace,
    args: argparse.Namespace,
    profile: EngineProfile,
    slo: SloTarget,
    cfg: PlannerConfig,
    real: tuple[Any, str] | None,
) -> bool:
    """All policies on one trace; prints the table and the comparison, returns the goal."""
    reqs = requests(trace, args.high, args.seed)
    peak_load = Load(args.high, trace.isl_mean, trace.osl_mean, trace.isl_cv)
    peak = recommend(peak_load, profile, slo)
    start = Load(trace.rate(0.0), trace.isl_mean, trace.osl_mean, trace.isl_cv)
    low = recommend(start, profile, slo)  # every autoscaler starts sized for t=0
    sim = {"slo": slo, "profile": profile, "startup_s": args.startup}
    fixed_r = simulate(
        reqs, trace.duration_s, fixed(peak.prefill, peak.decode), peak.prefill, peak.decode, **sim
    )
    plan_r = simulate(
        reqs,
        trace.duration_s,
        slo_planner(cfg, low.prefill, low.decode),
        low.prefill,
        low.decode,
        **sim,
    )
    hpa = []  # (name, result): the HPA's target and minReplicas, its cost knobs
    for target in (float(x) for x in args.targets.split(",")):
        for floor in (float(x) for x in args.floors.split(",")):
            p_min = max(1, math.ceil(floor * peak.prefill))
            d_min = max(1, math.ceil(floor * peak.decode))
            policy = hpa_queue(target, Bounds(p_min, peak.prefill), Bounds(d_min, peak.decode))
            p0, d0 = max(low.prefill, p_min), max(low.decode, d_min)
            name = f"target={target:g} min={p_min}P+{d_min}D"
            hpa.append((name, simulate(reqs, trace.duration_s, policy, p0, d0, **sim)))
    print(
        f"trace {trace.name}: {len(reqs)} requests over {trace.duration_s / 3600:g} h, "
        f"{trace.low:g}..{trace.high:g} req/s, prompt ~{trace.isl_mean:g} tok, "
        f"output ~{trace.osl_mean:g} tok"
    )
    print(f"  {'policy':<28}{'SLO met':>9}{'TTFT ok':>9}{'ITL ok':>9}{'GPU-h':>8}{'x fixed':>8}")

    def row(name: str, r: Result) -> None:
        print(
            f"  {name:<28}{r.attainment:>9.2%}{r.ttft_attainment:>9.2%}"
            f"{r.itl_attainment:>9.2%}{r.gpu_hours:>8.2f}{r.gpu_hours / fixed_r.gpu_hours:>8.2f}"
        )

    row(f"fixed-peak {peak.prefill}P+{peak.decode}D", fixed_r)
    for name, r in hpa:
        row(f"hpa {name}", r)  # maxReplicas: the peak sizing
    row("slo-planner", plan_r)
    if real is not None:
        t0 = time.monotonic()
        real_r = on_cluster(*real, trace, reqs, cfg, sim)
        row("slo-planner on cluster", real_r)
        print(f"  (on cluster: {time.monotonic() - t0:.0f} s wall, kwok pods Ready per tick)")
    # an HPA whose minReplicas is the peak sizing is the fixed sizing: the sweep's top end
    how, at = equal_cost(plan_r, [*hpa, ("min=max (fixed peak)", fixed_r)])
    usual = hpa[0][1]  # the first floor of the sweep (default 0: minReplicas 1)
    print(
        f"  queue HPA as usually set ({hpa[0][0]}): {usual.attainment:.2%} at "
        f"{usual.gpu_hours / plan_r.gpu_hours:.2f}x the planner's GPU-hours"
    )
    print(
        f"  at equal GPU-hours ({plan_r.gpu_hours:.2f}): planner {plan_r.attainment:.2%}, best "
        f"queue HPA {'n/a' if at is None else f'{at:.2%}'} ({how})"
    )
    met = (
        plan_r.attainment >= 0.99
        and plan_r.gpu_hours < fixed_r.gpu_hours
        and (at is None or plan_r.attainment > at)
    )
    print(
        f"  goal (>=99%, < fixed GPU-h, > queue HPA at equal GPU-h): "
        f"{'met' if met else 'NOT met'}\n"
    )
    return met


if __name__ == "__main__":
    raise SystemExit(main())
