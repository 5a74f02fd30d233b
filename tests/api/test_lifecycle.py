"""Admission limits, sleep/wake-up, session expiry and graceful SIGTERM on a real ``tandem serve``.

One server with one running slot and one waiting slot, so "full" is exact.
"""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest

from ..utils import ServerProcess, make_model, wait_until, wait_until_async

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_model(tmp_path_factory.mktemp("api-life-model"))
    srv = ServerProcess(
        model_dir,
        "--kv-cache-tokens",
        "8192",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--session-ttl",
        "1",
        "--shutdown-timeout",
        "60",
        "--role",
        "decode",
        log_path=tmp_path_factory.mktemp("api-life-log") / "server.log",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_role_is_reported(server: ServerProcess) -> None:
    assert server.health()["role"] == "decode"


def test_full_queue_is_429(server: ServerProcess) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            long = {"prompt": "Running", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=long) as running:
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass  # the first token is out: this request holds the only running slot
                waiting = asyncio.create_task(
                    c.post("/v1/completions", json={"prompt": "Waiting", "max_tokens": 3})
                )
                await wait_until_async(
                    lambda: _health_at_least(c, "pending_requests", 1), what="a waiting request"
                )
                full = await c.post("/v1/completions", json={"prompt": "Refused", "max_tokens": 3})
                err = _error(full, 429)
                assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
                sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    await sdk.completions.create(model="tiny", prompt="Refused too", max_tokens=3)
                metrics = (await c.get("/metrics")).text
                assert 'vllm:num_requests_waiting{model_name="tiny"} 1.0' in metrics
                assert 'vllm:num_requests_running{model_name="tiny"} 1.0' in metrics
            # leaving the stream aborted the long request; the waiting one now runs and finishes
            done = await waiting
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3

    asyncio.run(run())
    server.wait_idle()


def test_sleep_and_wakeup(server: ServerProcess) -> None:
    url = server.url
    assert (
        httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code
        == 200
    )
    r = httpx.post(url + "/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    err = _error(httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}), 503)
    assert "sleep" in err["message"]
    _error(httpx.post(url + "/generate", json={"prompt": "a"}), 503)
    h = httpx.get(url + "/health")
    assert h.status_code == 503 and h.json()["status"] == "sleeping"
    _error(httpx.post(url + "/sleep", params={"level": 3}), 400)
    assert httpx.post(url + "/wakeup").status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # level 2 drops the weights too; greedy output is the same after they are reloaded
    before = httpx.post(
        url + "/v1/completions", json={"prompt": "b", "max_tokens": 8, "temperature": 0}
    ).json()
    assert httpx.post(url + "/sleep", params={"level": 2}).status_code == 200
    assert httpx.post(url + "/wakeup").status_code == 200
    after = httpx.post(
        url + "/v1/completions", json={"prompt": "b", "max_tokens": 8, "temperature": 0}
    ).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_sleep_with_requests_in_flight_is_409(server: ServerProcess) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async with c.stream(
                "POST",
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True},
            ) as r:
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass
                _error(await c.post("/sleep"), 409)

    asyncio.run(run())
    server.wait_idle()
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}


def test_idle_sessions_expire(server: ServerProcess) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "session_id": "ttl",
        },
    )
    assert r.status_code == 200
    h = server.health()
    assert (
        h["active_sessions"] == 1
        and h["block_pool"]["free_blocks"] < h["block_pool"]["total_blocks"]
    )
    wait_until(
        lambda: not server.health()["active_sessions"], timeout=10, what="the session to expire"
    )
    server.wait_idle(timeout=1)


def test_sigterm_drains_then_exits(server: ServerProcess) -> None:
    """Runs last: SIGTERM refuses new work, lets the running stream finish, and exits 0."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "Drain", "max_tokens": 600, "ignore_eos": True, "stream": True},
        ) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            server.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _refused(server.url), what="new requests to be refused")
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        finals = [
            json.loads(x[5:])["choices"][0]["finish_reason"]
            for x in rest[:-1]
            if json.loads(x[5:])["choices"]
        ]
        assert finals[-1] == "length"
    assert server.proc.wait(30) == 0


async def _health_at_least(client: httpx.AsyncClient, field: str, n: int) -> bool:
    return (await client.get("/health")).json()[field] >= n


def _refused(url: str) -> bool:
    """A new request after SIGTERM: refused once the signal is handled (the listener is
    closed, or a 503); one sent before that is served, and the caller asks again."""
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
    except httpx.TransportError:
        return True
    assert r.status_code in (200, 503), r.text
    return r.status_code == 503
