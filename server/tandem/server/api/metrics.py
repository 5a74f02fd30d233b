"""Prometheus metrics, on a registry owned by one app (no process-global state).

Gauges are read from the engine loop's latest stats at scrape time. The ``vllm:`` names
are the ones the Kubernetes Gateway API Inference Extension's endpoint picker reads from
model servers (queue depth, running requests, KV cache usage); the ``tandem:`` names carry
the same values plus latency histograms and token counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.server.engine.stats import EngineStats

from .engine_loop import AsyncEngine

if TYPE_CHECKING:
    from ..engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_E2E_BUCKETS = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class _SnapshotCollector(Collector):
    """Gauges computed from the engine loop's stats when Prometheus scrapes."""

    def __init__(self, model: str, engine: Callable[[], AsyncEngine]) -> None:
        self._model = model
        self._engine = engine

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # computed at scrape time; nothing to describe before the engine exists

    def collect(self) -> Iterator[GaugeMetricFamily]:
        e = self._engine()
        s = e.stats
        waiting = s.num_waiting + e.num_queued_adds
        usage = s.kv_utilization
        values = [
            ("num_requests_waiting", "Requests waiting to be scheduled", waiting),
            ("num_requests_running", "Requests being generated", s.num_running),
            ("gpu_cache_usage_perc", "KV cache usage; 1 means full", usage),
            ("kv_cache_usage_perc", "KV cache usage; 1 means full", usage),
        ]
        for prefix in ("vllm:", "tandem:"):
            for name, doc, value in values:
                g = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
                g.add_metric([self._model], value)
                yield g
        for name, doc, value in [
            ("num_sessions", "Sessions holding KV blocks between turns", s.num_sessions),
            ("kv_cache_total_blocks", "KV cache blocks in the pool", s.total_blocks),
            (
                "kv_cache_free_blocks",
                "KV cache blocks free (including evictable cached ones)",
                s.free_blocks,
            ),
            ("prefix_cache_hit_rate", "Prefix cache hit rate", s.prefix_hit_rate),
            ("is_sleeping", "1 while the engine has released its memory", int(s.is_sleeping)),
            ("engine_ready", "1 once the engine has loaded and can serve", int(e.state == "ready")),
            ("num_preemptions", "Preemptions since start", s.num_preemptions),
            (
                "engine_step_seconds",
                "Seconds spent inside engine steps since start (model, sampler, detokenizer)",
                e.step_seconds,
            ),
        ]:
            g = GaugeMetricFamily("tandem:" + name, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            yield g
        yield from _spec_decode_counters(self._model, s)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache configuration",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(s.block_size), str(s.total_blocks)], 1)
        yield info
        if s.max_loras:
            yield _lora_info(s)


def _lora_info(s: EngineStats) -> GaugeMetricFamily:
    """The Gateway API Inference Extension's LoRA metric, as vLLM exports it: the adapters
    of the running and the waiting requests as comma-separated labels, the value the time
    of the reading (a scraper keeps the newest series)."""
    g = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on LoRA requests",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    labels = [str(s.max_loras), ",".join(s.running_loras), ",".join(s.waiting_loras)]
    g.add_metric(labels, time.time())
    return g


def _spec_decode_counters(model: str, s: EngineStats) -> Iterator[CounterMetricFamily]:
    """vLLM's speculative decoding counters (``_total`` in the text format), on an engine that
    speculates: proposals, tokens proposed, tokens accepted, and accepted per position."""
    if not s.spec_accepted_per_position:
        return
    for name, doc, value in [
        ("spec_decode_num_drafts", "Proposals verified", s.spec_num_drafts),
        ("spec_decode_num_draft_tokens", "Tokens proposed", s.spec_num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Proposed tokens accepted", s.spec_num_accepted_tokens),
    ]:
        c = CounterMetricFamily("vllm:" + name, doc, labels=["model_name"])
        c.add_metric([model], value)
        yield c
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Proposed tokens accepted at each position of their proposal",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(s.spec_accepted_per_position):
        per_pos.add_metric([model, str(pos)], value)
    yield per_pos


class ServerMetrics:
    """All of one server's metrics; also the engine loop's ``EngineMetrics`` observer."""

    def __init__(self, model: str, engine: Callable[[], AsyncEngine]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model = model
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Time from arrival to the first token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model)
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between output tokens",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(model)
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Time from arrival to the last token",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(model)
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens", "Prompt tokens received", labels, registry=r
        ).labels(model)
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Tokens generated", labels, registry=r
        ).labels(model)
        self.cached_prompt_tokens = Counter(
            "tandem:prompt_tokens_cached",
            "Prompt tokens not recomputed (prefix cache or session)",
            labels,
            registry=r,
        )
        self.cached_prompt_tokens_m = self.cached_prompt_tokens.labels(model)
        self._finished = Counter(
            "tandem:request_success",
            "Requests finished, by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._http_errors = Counter(
            "tandem:request_errors",
            "Requests refused, by HTTP status",
            ["model_name", "status"],
            registry=r,
        )
        self.lora_config_errors = Gauge(
            "tandem:lora_config_errors",
            "Entries of the --lora-config file not served (the file itself, or an adapter)",
            registry=r,
        )
        r.register(_SnapshotCollector(model, engine))

    # EngineMetrics (called on the engine thread; prometheus_client is thread-safe)
    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_tokens(self, seconds: float, count: int) -> None:
        # One engine step adds one token to each choice: the interval is the inter-token latency.
        self.itl.observe(seconds)

    def on_finished(
        self, reasons: list[str], num_tokens: int, num_cached_tokens: int, e2e_seconds: float
    ) -> None:
        self.e2e.observe(e2e_seconds)
        self.generation_tokens.inc(num_tokens)
        self.cached_prompt_tokens_m.inc(num_cached_tokens)
        for reason in reasons:
            self._finished.labels(self._model, reason).inc()

    def on_aborted(self, count: int) -> None:
        self._finished.labels(self._model, "abort").inc(count)

    def on_error(self, status: int) -> None:
        self._http_errors.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
