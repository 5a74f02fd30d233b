"""The proxy's per-request deadline (``proxy/deadline.py``) and how the flow shares it:
model-free, the clock injected, no sleeps racing it."""

from __future__ import annotations

import asyncio

import pytest

from tandem.server.proxy.deadline import Deadline
from tandem.server.proxy.pd_flow import FlowConfig, PDFlow, _gave_up
from tandem.server.proxy.registry import DECODE_ROLES, HealthPoller, Registry


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_deadline_counts_from_arrival_and_restarts_on_progress() -> None:
    clock = Clock()
    d = Deadline(10.0, clock)
    clock.t += 6
    assert d.remaining() == pytest.approx(4.0) and not d.expired()
    d.progress()  # a byte reached the client
    clock.t += 9.5
    assert not d.expired() and d.remaining() == pytest.approx(0.5)
    clock.t += 0.5
    assert d.expired() and d.remaining() == 0.0


def test_waits_share_one_budget() -> None:
    """Stall detection then a wait for a returning engine: 10 s in total, not 10 + 10."""
    clock = Clock()
    d = Deadline(10.0, clock)
    clock.t += 7  # the first engine was silent this long before it was given up
    assert not _gave_up(None, 7.0, d)
    clock.t += 3  # the wait for an engine expected back draws on what is left
    assert _gave_up(None, 3.0, d)


def test_capped_step_leaves_the_rest_to_the_next() -> None:
    clock = Clock()
    d = Deadline(10.0, clock)
    step = d.capped(5.0)
    clock.t += 5
    assert step.expired() and not d.expired()
    clock.t += 2
    late = d.capped(5.0)  # never later than the request's own deadline
    assert late.remaining() == pytest.approx(3.0)


def test_bad_budget_refused() -> None:
    with pytest.raises(ValueError):
        Deadline(0)


def test_unbounded_wait_gives_up_only_on_a_node_found_down() -> None:
    reg = Registry()
    node = reg.add("http://127.0.0.1:9", "decode")
    node.healthy = True
    assert not _gave_up(node, 1e6, None)
    reg.record_failure(node.url, "silent", stalled=True)
    assert _gave_up(node, 2.0, None) and not _gave_up(node, 1.0, None)


def _flow(clock: Clock) -> tuple[PDFlow, Registry, list[list[str]]]:
    reg = Registry(clock=clock)
    flow = PDFlow(reg, client=None, config=FlowConfig(stall_timeout=10.0))  # type: ignore[arg-type]
    probed: list[list[str]] = []
    flow.reprobe = probed.append
    return flow, reg, probed


def test_waiting_for_a_returning_engine_reprobes_it_and_stops_at_the_deadline() -> None:
    clock = Clock()
    flow, reg, probed = _flow(clock)
    node = reg.add("http://127.0.0.1:9", "decode")
    node.healthy = node.ever_healthy = True
    reg.record_failure(node.url, "stalled", stalled=True)
    deadline = Deadline(10.0, clock)
    clock.t += 10  # the budget went on detecting the stall
    nodes = asyncio.run(flow._await_engines(None, None, deadline))  # type: ignore[arg-type]
    assert nodes == [] and probed == []  # nothing left to wait with

    deadline = Deadline(10.0, clock)

    def back(urls: list[str]) -> None:  # the re-probe finds it answering again
        probed.append(urls)
        reg.record_health(urls[0], 200, {})

    flow.reprobe = back
    nodes = asyncio.run(flow._await_engines(None, None, deadline))  # type: ignore[arg-type]
    assert [n.url for n in nodes] == [node.url] and probed == [[node.url]]
    assert flow.stats.waits == 1


def test_returning_lists_only_engines_expected_back() -> None:
    clock = Clock()
    reg = Registry(clock=clock, startup_grace=60)
    up = reg.add("http://127.0.0.1:1", "decode")
    up.healthy = up.ever_healthy = True
    gone = reg.add("http://127.0.0.1:2", "decode")
    gone.ever_healthy = True
    reg.add("http://127.0.0.1:3", "prefill")
    clock.t += 61
    reg.add("http://127.0.0.1:4", "decode")  # loading, in its grace
    assert [n.url for n in reg.returning(DECODE_ROLES)] == [gone.url, "http://127.0.0.1:4"]
    assert reg.expected_back(DECODE_ROLES)


def test_suspected_node_gets_the_short_probe_timeout_and_reprobes_are_rate_limited() -> None:
    clock = Clock()
    reg = Registry(clock=clock)
    node = reg.add("http://127.0.0.1:9", "decode")
    poller = HealthPoller(reg, client=None, timeout=5.0)  # type: ignore[arg-type]
    assert poller.probe_timeout(node) == 5.0
    reg.record_failure(node.url, "silent")
    assert poller.probe_timeout(node) == 2.0

    calls: list[tuple[str, float | None]] = []

    async def fake_probe(url: str, timeout: float | None = None) -> None:
        calls.append((url, timeout))

    poller.probe = fake_probe  # type: ignore[method-assign]

    async def run() -> None:
        poller.reprobe([node.url])
        poller.reprobe([node.url])  # within REPROBE_MIN_INTERVAL: skipped
        clock.t += 1
        poller.reprobe([node.url])
        await asyncio.gather(*poller._tasks)

    asyncio.run(run())
    assert calls == [(node.url, 2.0), (node.url, 2.0)]
