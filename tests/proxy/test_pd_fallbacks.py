"""The P/D flow's ways out, each alone (``PDFlow.disaggregated``): P's own refusal passed on,
and each aggregated fallback (no handoff, a failed KV pull, no decode engine taking the
handoff). Model-free: the engines are an ``httpx.MockTransport``, the client a bare request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import Request

from tandem.server.proxy.pd_flow import FlowConfig, Job, PDFlow
from tandem.server.proxy.registry import DECODE_ROLES, Registry
from tandem.server.wire.errors import APIError

P, D1, D2 = "http://p:1", "http://d1:1", "http://d2:1"
KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_lease_id": "l"}
BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}


class Engines:
    """Mock engines: ``answer(url, body)`` per request, every request kept in ``seen``."""

    def __init__(self, answer: Callable[[str, dict[str, Any]], httpx.Response]) -> None:
        self.answer = answer
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content) if request.content else {}
        self.seen.append((base, request.url.path, body))
        return self.answer(base, body)

    def calls(self, url: str, path: str = "/v1/completions") -> list[dict[str, Any]]:
        return [b for u, p, b in self.seen if u == url and p == path]


def engine(url: str, body: dict[str, Any], *, handoff: bool = True) -> httpx.Response:
    """A healthy engine: P's one token (with a handoff, unless not), D's whole answer."""
    if body.get("kv_transfer_params", {}).get("do_remote_decode"):
        return httpx.Response(
            200, json={"choices": [{"text": "a"}]} | ({"kv_transfer_params": KV} if handoff else {})
        )
    return httpx.Response(200, json={"choices": [{"text": f"from {url}"}]})


def failing_at(
    url: str, failure: httpx.Response | Exception, handoff_only: bool = False
) -> Callable[[str, dict[str, Any]], httpx.Response]:
    """Healthy engines, but ``url`` answers ``failure`` (or raises it): to every request, or
    with ``handoff_only`` to the decode step's (one carrying P's handle) alone."""

    def answer(at: str, body: dict[str, Any]) -> httpx.Response:
        if at != url or (handoff_only and "kv_transfer_params" not in body):
            return engine(at, body)
        if isinstance(failure, Exception):
            raise failure
        return failure

    return answer


def _request() -> Request:
    async def receive() -> dict[str, Any]:  # the client never leaves
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return Request(scope, receive)


def _flow(engines: Engines, decoders: tuple[str, ...] = (D1,), **config: Any) -> PDFlow:
    reg = Registry()
    for url, role in [(P, "prefill"), *((d, "decode") for d in decoders)]:
        reg.add(url, role, ["m"], source="static")
        reg.record_health(url, 200, {})
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    return PDFlow(reg, client, FlowConfig(disagg_threshold=0, **config))


def _handle(flow: PDFlow) -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, dict[str, Any]]:
        response = await flow.handle("completions", dict(BODY), _request())
        await flow.aclose()  # background lease releases done
        return response.status_code, json.loads(response.body)

    return asyncio.run(go())


def _modes(flow: PDFlow) -> dict[str, int]:
    return {mode: n for (_, mode, _), n in flow.stats.requests.items()}


def test_the_happy_path_is_prefill_then_decode() -> None:
    engines = Engines(engine)
    flow = _flow(engines)
    status, body = _handle(flow)
    assert status == 200 and body["choices"][0]["text"] == f"from {D1}"
    (prefilled,) = engines.calls(P)
    assert prefilled["max_tokens"] == 1 and prefilled["kv_transfer_params"] == {
        "do_remote_decode": True
    }
    (decoded,) = engines.calls(D1)
    assert decoded["kv_transfer_params"] == {**KV, "remote_engine_url": P}
    assert _modes(flow) == {"disaggregated": 1} and flow.stats.fallbacks_aggregated == 0


def test_prefills_refusal_of_the_request_is_the_answer() -> None:
    refusal = httpx.Response(400, json={"error": {"message": "bad", "code": "invalid_value"}})
    engines = Engines(failing_at(P, refusal))
    flow = _flow(engines)
    status, body = _handle(flow)
    assert status == 400 and body["error"]["code"] == "invalid_value"
    assert engines.calls(D1) == [] and _modes(flow) == {"disaggregated": 1}


def test_no_handoff_runs_the_request_aggregated_on_its_decode_engine() -> None:
    engines = Engines(lambda url, body: engine(url, body, handoff=False))
    flow = _flow(engines)
    status, body = _handle(flow)
    assert status == 200 and body["choices"][0]["text"] == f"from {D1}"
    (whole,) = engines.calls(D1)
    assert "kv_transfer_params" not in whole and whole["max_tokens"] == 4
    assert _modes(flow) == {"aggregated_fallback": 1} and flow.stats.fallbacks_aggregated == 1


def test_no_prefill_engine_answering_is_no_handoff_too() -> None:
    flow = _flow(Engines(failing_at(P, httpx.ConnectError("refused"))))
    status, _ = _handle(flow)
    assert status == 200 and _modes(flow) == {"aggregated_fallback": 1}
    assert flow.stats.prefill_failures == 1


def test_a_failed_kv_pull_frees_ps_lease_suspects_p_and_runs_aggregated_on_d() -> None:
    pull_failed = httpx.Response(502, json={"error": {"message": "pull failed"}})
    engines = Engines(failing_at(D1, pull_failed, handoff_only=True))
    flow = _flow(engines)
    status, body = _handle(flow)
    assert status == 200 and body["choices"][0]["text"] == f"from {D1}"
    decoded, whole = engines.calls(D1)
    assert "kv_transfer_params" in decoded and "kv_transfer_params" not in whole
    assert [u for u, p, _ in engines.seen if p == "/distserve/free_cache"] == [P]
    assert flow.registry.get(P).failures == 1 and flow.stats.prefill_failures == 1
    assert _modes(flow) == {"aggregated_fallback": 1}


def test_no_decoder_taking_the_handoff_frees_p_and_runs_aggregated_elsewhere() -> None:
    engines = Engines(failing_at(D1, httpx.ConnectError("refused")))
    flow = _flow(engines, decoders=(D1, D2), max_attempts=1, policy="round_robin")
    status, body = _handle(flow)
    assert status == 200 and body["choices"][0]["text"] == f"from {D2}"
    (whole,) = engines.calls(D2)
    assert "kv_transfer_params" not in whole
    assert [u for u, p, _ in engines.seen if p == "/distserve/free_cache"] == [P]
    assert _modes(flow) == {"aggregated_fallback": 1} and flow.stats.decode_failures == 1


def test_no_decoder_and_none_left_is_a_503() -> None:
    flow = _flow(Engines(engine))
    job = Job("completions", dict(BODY), _request(), [], 4, flow.deadline())
    decoders = flow.registry.routable(DECODE_ROLES)
    for node in decoders:
        flow.registry.remove(node.url)

    with pytest.raises(APIError) as err:
        asyncio.run(flow._no_decoder(job, decoders, {d.url for d in decoders}))
    assert err.value.status == 503 and flow.stats.fallbacks_aggregated == 0
